"""Lookup actor: prefix lookups for one rank, through a client that stores nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvray.backends import make_backend
from kvray.config import PoolConfig
from kvray.keys import KeySpace, probe_hash
from kvray.lookup import LookupService


class LookupActor:
    def __init__(self, config_json: str, rank: int, server_address: str) -> None:
        logging.basicConfig(level=logging.INFO)
        config = PoolConfig.model_validate_json(config_json)
        self._rank = rank
        self._service = LookupService(make_backend(config, server_address, contribute_memory=False))

    async def probe(self) -> dict[str, Any]:
        return {"rank": self._rank, "probe_hash": probe_hash()}

    async def lookup(self, space: KeySpace, hashes: Sequence[bytes], timeout_s: float) -> int:
        return await self._service.lookup(space, hashes, timeout_s)

    async def snapshot(self) -> dict[str, Any]:
        return {"rank": self._rank, "stats": self._service.stats.to_dict()}

    async def close(self) -> None:
        await self._service.backend.close()
