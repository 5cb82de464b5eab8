"""BackendClient actor: one rank's backend client, its mapped regions and counters."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray

from kvray.backends import KeyStatus, make_backend
from kvray.config import PoolConfig
from kvray.keys import probe_hash
from kvray.launcher import ManagerLink, on_this_node
from kvray.ledger import FLUSH_S, Entries, Seen, block_digest
from kvray.metrics import export_forever
from kvray.rank_store import RankStore
from kvray.ray_env import normal_priority
from kvray.shm import RegionSpec
from kvray.stats import RankStats
from kvray.transfer import TransferBatch

logger = logging.getLogger(__name__)

_LOWER_TIER_SERVES = (KeyStatus.NOT_FOUND, KeyStatus.TRANSFER_FAILED, KeyStatus.CORRUPT)
"""DRAM outcomes the SSD tier may still turn into a hit (it rewrites every byte)."""


class BackendClientActor:
    """All methods are async; native calls run on the backend's own thread pool."""

    def __init__(self, config_json: str, rank: int, server_address: str, ssd: Any = None) -> None:
        logging.basicConfig(level=logging.INFO)
        normal_priority("BackendClient actor")
        config = on_this_node(PoolConfig.model_validate_json(config_json))
        mc = config.mooncake
        if mc.enable_client_http_server:  # one port per client of the node
            mooncake = mc.model_copy(update={"client_http_port": mc.client_http_port + rank})
            config = config.model_copy(update={"mooncake": mooncake})
        self._store = RankStore(make_backend(config, server_address), rank)
        self._node_id = ray.get_runtime_context().get_node_id()
        # Pipeline "<backend>|ssd": the SSD offload actor of the same node and slot is
        # the lower tier (the manager makes it first and hands it over).
        assert (ssd is not None) == config.ssd_tier, "an SSD actor exactly with an ssd tier"
        self._ssd: Any = ssd
        self._config = config
        self._changes: Entries = []
        self._reporter: asyncio.Task[None] | None = None
        self._exporter: asyncio.Task[None] | None = None

    def _ensure_exporter(self) -> None:
        # Started from the first async call: __init__ runs before the actor's loop does.
        if self._exporter is None:
            self._exporter = asyncio.get_running_loop().create_task(
                export_forever(self._config.name, "client", self._store.rank, self._metrics)
            )

    async def _metrics(self) -> tuple[RankStats, int | None]:
        return self._store.stats, int(self._store.backend.info().get("segment_bytes") or 0)

    def _note(self, keys: Sequence[str], statuses: Sequence[KeyStatus], what: Seen) -> None:
        """Remember blocks stored or removed, for the pool's ledger (sent every FLUSH_S)."""
        now = time.time()
        self._changes.extend(
            (block_digest(k), int(what), now)
            for k, s in zip(keys, statuses, strict=True)
            if s is KeyStatus.OK
        )
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(self._report())

    async def _report(self) -> None:
        manager = ManagerLink(self._config, "BackendClient", "its misses read as never stored")
        while True:
            await asyncio.sleep(FLUSH_S)
            if self._changes:
                changes, self._changes = self._changes, []
                await manager.call("ledger_record", changes)

    async def probe(self) -> dict[str, Any]:
        self._ensure_exporter()
        return {
            "rank": self._store.rank,
            "pid": os.getpid(),
            "probe_hash": probe_hash(),
            "node_id": self._node_id,
        }

    async def put(self, batch: TransferBatch, overwrite: bool = False) -> list[KeyStatus]:
        self._ensure_exporter()
        statuses = await self._put(batch, overwrite)
        self._note(batch.keys, statuses, Seen.STORED)
        return statuses

    async def _put(self, batch: TransferBatch, overwrite: bool) -> list[KeyStatus]:
        ssd = self._ssd
        if ssd is None:
            return await self._store.put(batch, overwrite=overwrite)
        # Write-through to both tiers at once; the caller may reuse its memory when this
        # returns, so the SSD write is awaited too. Stored in either tier is stored.
        dram, lower = await asyncio.gather(
            self._store.put(batch, overwrite=overwrite), ssd.put.remote(batch, overwrite)
        )
        self._store.stats.ssd_put_keys += sum(s is KeyStatus.OK for s in lower)
        return [
            KeyStatus.OK if KeyStatus.OK in (d, s) else d for d, s in zip(dram, lower, strict=True)
        ]

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        statuses = await self._store.get(batch)
        ssd = self._ssd
        if ssd is None:
            return statuses
        misses = [i for i, s in enumerate(statuses) if s in _LOWER_TIER_SERVES]
        if misses:
            sub = batch.take(misses)
            lower = await ssd.get.remote(sub)
            nbytes = sub.key_nbytes()
            for j, (i, s) in enumerate(zip(misses, lower, strict=True)):
                if s is KeyStatus.OK:
                    statuses[i] = KeyStatus.OK
                    self._store.stats.ssd_get_keys += 1
                    self._store.stats.ssd_get_bytes += int(nbytes[j])
        return statuses

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        present = await self._store.exists(keys)
        ssd = self._ssd
        if ssd is None or all(present):
            return present
        lower = await ssd.exists.remote(list(keys))
        return [a or b for a, b in zip(present, lower, strict=True)]

    async def remove(self, keys: Sequence[str], force: bool = False) -> list[KeyStatus]:
        statuses = await self._store.remove(keys, force=force)
        ssd = self._ssd
        if ssd is not None:
            lower = await ssd.remove.remote(list(keys), force)
            statuses = [
                KeyStatus.OK if KeyStatus.OK in (d, s) else d
                for d, s in zip(statuses, lower, strict=True)
            ]
        self._note(keys, statuses, Seen.REMOVED)
        return statuses

    async def map_region(self, spec: RegionSpec) -> None:
        """Map (and register) a region before its first transfer: an engine calls this
        as it registers its KV cache, so mapping a large cache is paid at startup."""
        await self._store.ensure_region(spec)
        if self._ssd is not None:
            await self._ssd.map_region.remote(spec)

    async def release_region(self, region_id: str) -> None:
        await self._store.release_region(region_id)
        ssd = self._ssd
        if ssd is not None:
            await ssd.release_region.remote(region_id)

    async def health(self) -> bool:
        return await self._store.backend.health()

    async def snapshot(self) -> dict[str, Any]:
        return self._store.snapshot()

    async def close(self) -> None:
        await self._store.close()
