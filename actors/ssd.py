"""SSD offload manager actor: one rank's SSD tier (files under ``<ssd.path>/rank_<N>/``),
in the rank's placement-group bundle so that it writes the rank's own node's disk."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from kvray import remote
from kvray.backends import KeyStatus
from kvray.backends.ssd import SsdBackend
from kvray.config import PoolConfig
from kvray.index.stream import OP_ADD, OP_GONE
from kvray.keys import probe_hash
from kvray.metrics import export_forever
from kvray.ray_env import normal_priority
from kvray.shm import RegionSpec
from kvray.stats import RankStats
from kvray.store.index_publisher import IndexPublisher
from kvray.store.rank_store import RankStore
from kvray.transfer import TransferBatch


class SsdOffloadActor:
    def __init__(self, config_json: str, rank: int) -> None:
        logging.basicConfig(level=logging.INFO)
        normal_priority("SSD offload actor")
        config = PoolConfig.model_validate_json(config_json)
        assert config.ssd is not None, "launcher starts SSD actors only with an ssd section"
        self._tier = SsdBackend(config.ssd, rank, save_niceness=config.save_niceness)
        self._store = RankStore(self._tier, rank)
        self._name = config.name
        self._exporter: asyncio.Task[None] | None = None
        self._index: IndexPublisher | None = None
        """The tier's blocks for the pool's block indexes (``lookup_index``): all it holds
        at start, then what its quota evicts (stores and removes the BackendClient above
        it reports)."""
        if config.lookup_index:
            self._index = IndexPublisher(config, remote.node_id(), "SSD offload")
            self._tier.evicted = []
        self._publisher: asyncio.Task[None] | None = None
        self._announced = asyncio.Lock()
        self._announce_done = False

    async def probe(self) -> dict[str, Any]:
        self._ensure_exporter()
        await self._announce()
        return {"rank": self._store.rank, "pid": os.getpid(), "probe_hash": probe_hash()}

    async def _announce(self) -> None:
        """Everything the tier holds, once, before any other call of this actor changes
        it (the launcher probes each actor it makes before handing it out)."""
        if self._index is None or self._announce_done:
            return
        async with self._announced:
            if not self._announce_done:
                keys = self._tier.keys()
                if keys:
                    await self._index.publish([self._index.changes(OP_ADD, keys, self._store.rank)])
                self._announce_done = True

    async def put(self, batch: TransferBatch, overwrite: bool = False) -> list[KeyStatus]:
        self._ensure_exporter()
        await self._announce()
        statuses = await self._store.put(batch, overwrite=overwrite)
        if self._index is not None:
            evicted = self._tier.take_evicted()
            if evicted:
                await self._index.publish([self._index.changes(OP_GONE, evicted, self._store.rank)])
        return statuses

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        return await self._store.get(batch)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._store.exists(keys)

    async def remove(self, keys: Sequence[str], force: bool = False) -> list[KeyStatus]:
        return await self._store.remove(keys, force=force)

    async def map_region(self, spec: RegionSpec) -> None:
        await self._store.ensure_region(spec)

    async def release_region(self, region_id: str) -> None:
        await self._store.release_region(region_id)

    async def snapshot(self) -> dict[str, Any]:
        self._ensure_exporter()
        return {**self._store.snapshot(), "tier": self._tier_stats().to_dict()}

    def _tier_stats(self) -> RankStats:
        """What the tier adds to its client's counters (the rest the client counts)."""
        s = self._tier.stats
        usage = self._tier.usage()
        return RankStats(
            ssd_blocks=usage["blocks"],
            ssd_used_bytes=usage["used_bytes"],
            ssd_evictions=s.evictions,
            ssd_corrupt=s.corrupt,
        )

    def _ensure_exporter(self) -> None:
        # Started from the first async call: __init__ runs before the actor's loop does.
        if self._exporter is None:
            loop = asyncio.get_running_loop()
            self._exporter = loop.create_task(
                export_forever(self._name, "ssd", self._store.rank, self._metrics)
            )
            if self._index is not None:
                self._publisher = loop.create_task(self._index.run())

    async def _metrics(self) -> tuple[RankStats, int | None]:
        return self._tier_stats(), None

    async def close(self) -> None:
        for task in (self._exporter, self._publisher):
            if task is not None:
                task.cancel()
        await self._store.close()
