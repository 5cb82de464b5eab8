"""BackendClient actor: one rank's backend client, its mapped regions and counters."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import ray

from kvray.backends import KeyStatus, make_backend
from kvray.config import PoolConfig
from kvray.keys import probe_hash
from kvray.rank_store import RankStore
from kvray.transfer import TransferBatch


class BackendClientActor:
    """All methods are async; native calls run on the backend's own thread pool."""

    def __init__(self, config_json: str, rank: int, server_address: str) -> None:
        logging.basicConfig(level=logging.INFO)
        config = PoolConfig.model_validate_json(config_json)
        self._store = RankStore(make_backend(config, server_address), rank)

    async def probe(self) -> dict[str, Any]:
        return {
            "rank": self._store.rank,
            "pid": os.getpid(),
            "probe_hash": probe_hash(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    async def put(self, batch: TransferBatch, overwrite: bool = False) -> list[KeyStatus]:
        return await self._store.put(batch, overwrite=overwrite)

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        return await self._store.get(batch)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._store.exists(keys)

    async def remove(self, keys: Sequence[str], force: bool = False) -> list[KeyStatus]:
        return await self._store.remove(keys, force=force)

    async def release_region(self, region_id: str) -> None:
        await self._store.release_region(region_id)

    async def health(self) -> bool:
        return await self._store.backend.health()

    async def snapshot(self) -> dict[str, Any]:
        return self._store.snapshot()

    async def close(self) -> None:
        await self._store.close()
