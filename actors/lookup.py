"""Lookup actor: prefix lookups for one rank, through a client that stores nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray

from kvray.backends import make_backend
from kvray.config import PoolConfig
from kvray.keys import KeySpace, probe_hash
from kvray.lookup import LookupService
from kvray.naming import ssd_name


class LookupActor:
    def __init__(self, config_json: str, rank: int, server_address: str) -> None:
        logging.basicConfig(level=logging.INFO)
        config = PoolConfig.model_validate_json(config_json)
        self._rank = rank
        self._config = config
        lower = self._ssd_exists if config.ssd_tier else None
        backend = make_backend(config, server_address, contribute_memory=False)
        self._service = LookupService(backend, lower)
        self._ssd: dict[int, Any] = {}

    async def _ssd_exists(self, rank: int, keys: list[str]) -> list[bool]:
        """Rank ``rank``'s SSD tier (its blocks live on its own node's disk)."""
        actor = self._ssd.get(rank)
        if actor is None:
            actor = ray.get_actor(
                ssd_name(self._config.name, rank), namespace=self._config.namespace
            )
            self._ssd[rank] = actor
        present: list[bool] = await actor.exists.remote(keys)
        return present

    async def probe(self) -> dict[str, Any]:
        return {"rank": self._rank, "probe_hash": probe_hash()}

    async def lookup(
        self,
        space: KeySpace,
        hashes: Sequence[bytes],
        timeout_s: float,
        want: int = 0,
        wait_s: float = 0.0,
    ) -> int:
        return await self._service.lookup(space, hashes, timeout_s, want, wait_s)

    async def snapshot(self) -> dict[str, Any]:
        return {"rank": self._rank, "stats": self._service.stats.to_dict()}

    async def close(self) -> None:
        await self._service.backend.close()
