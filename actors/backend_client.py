"""BackendClient actor: one rank's backend client, its mapped regions and counters."""

from __future__ import annotations

import asyncio
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

logger = logging.getLogger(__name__)

REGION_SWEEP_S = 30.0
"""How often mappings of regions whose owner went away are dropped."""


class BackendClientActor:
    """All methods are async; native calls run on the backend's own thread pool."""

    def __init__(self, config_json: str, rank: int, server_address: str) -> None:
        logging.basicConfig(level=logging.INFO)
        config = PoolConfig.model_validate_json(config_json)
        self._store = RankStore(make_backend(config, server_address), rank)
        self._sweeper: asyncio.Task[None] | None = None

    def _ensure_sweeper(self) -> None:
        # Started from the first data call: __init__ runs before the actor's loop does.
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_regions())

    async def _sweep_regions(self) -> None:
        """Reconcile loop: each pass is idempotent and a failure only skips one pass."""
        while True:
            await asyncio.sleep(REGION_SWEEP_S)
            try:
                await self._store.drop_stale_regions()
            except Exception:
                logger.exception("rank %d: region sweep failed", self._store.rank)

    async def probe(self) -> dict[str, Any]:
        return {
            "rank": self._store.rank,
            "pid": os.getpid(),
            "probe_hash": probe_hash(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    async def put(self, batch: TransferBatch, overwrite: bool = False) -> list[KeyStatus]:
        self._ensure_sweeper()
        return await self._store.put(batch, overwrite=overwrite)

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        self._ensure_sweeper()
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
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self._store.close()
