"""BackendClient actor: one rank's tiers (:class:`kvray.store.tiers.TieredStore`) on the
rank's node, and its reports to the pool (ledger, metrics)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvray import remote
from kvray.actors.node_config import current_settings, on_this_node
from kvray.backends import KeyStatus, make_backend
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.index.ledger import FLUSH_S
from kvray.index.stream import OP_ADD, OP_GONE
from kvray.keys import probe_hash
from kvray.metrics import export_forever
from kvray.ray_env import normal_priority
from kvray.remote import ManagerHandle, ManagerLink, Remake, StoreHandle
from kvray.shm import RegionSpec
from kvray.stats import RankStats
from kvray.store.channel import ChannelServer
from kvray.store.index_publisher import SWEEP_S, EvictionSweep, IndexPublisher
from kvray.store.rank_store import RankStore
from kvray.store.tiers import IndexKeys, RemoteTier, TieredStore
from kvray.transfer import TransferBatch

logger = logging.getLogger(__name__)


class BackendClientActor:
    """All methods are async; native calls run on the backend's own thread pool."""

    def __init__(
        self,
        config_json: str,
        rank: int,
        server_address: str,
        ssd: StoreHandle | None = None,
        remake: Remake | None = None,
    ) -> None:
        """``remake``: how to make the pool's manager again (:class:`ManagerLink`)."""
        logging.basicConfig(level=logging.INFO)
        normal_priority("BackendClient actor")
        config_json, server_address = current_settings(config_json, server_address)
        config = on_this_node(PoolConfig.model_validate_json(config_json))
        config = spec_of(config.backend).for_rank(config, rank)
        # Pipeline "<backend>|ssd": the SSD offload actor of the same node and slot is
        # the lower tier (the manager makes it first and hands it over).
        assert (ssd is not None) == config.ssd_tier, "an SSD actor exactly with an ssd tier"
        lower = RemoteTier(ssd, config.call_timeout_s) if ssd is not None else None
        self._store = RankStore(make_backend(config, server_address), rank)
        self._tiers = TieredStore(self._store, lower)
        self._node_id = remote.node_id()
        self._config = config
        self._remake = remake
        self._background: list[asyncio.Task[None]] = []
        self._channel: ChannelServer | None = None
        """The node channel workers send their transfers over (:mod:`kvray.store.channel`)."""
        self._index: IndexPublisher | None = None
        """Changes to the pool's block indexes (``lookup_index``)."""
        if config.lookup_index:
            self._index = IndexPublisher(config, self._node_id, "BackendClient")
            self._index.sweep = EvictionSweep()

    def _ensure_background(self) -> None:
        # Started from the first async call: __init__ runs before the actor's loop does.
        if not self._background:
            loop = asyncio.get_running_loop()
            self._background = [
                loop.create_task(
                    export_forever(self._config.name, "client", self._store.rank, self._metrics)
                ),
                loop.create_task(self._report()),
            ]
            if self._index is not None:
                self._background.append(loop.create_task(self._index.run()))
                self._background.append(loop.create_task(self._sweep_evictions()))

    async def _metrics(self) -> tuple[RankStats, int | None]:
        return self._store.stats, int(self._store.backend.info().get("segment_bytes") or 0)

    async def _report(self) -> None:
        """Send the blocks stored and removed to the pool's ledger every FLUSH_S."""
        manager = ManagerLink(
            self._config, "BackendClient", "its misses read as never stored", remake=self._remake
        )
        while True:
            await asyncio.sleep(FLUSH_S)
            changes = self._tiers.take_changes()
            if len(changes):
                await manager.call(partial(ManagerHandle.ledger_record, changes=changes))

    async def _sweep_evictions(self) -> None:
        """Reconcile the DRAM keys this client stored with the backend (what it evicted
        is published gone): kvray.store.index_publisher.EvictionSweep."""
        assert self._index is not None and self._index.sweep is not None
        sweep = self._index.sweep
        while True:
            await asyncio.sleep(SWEEP_S)
            await self._index.hear_evictions()
            keys = sweep.due()
            if not keys:
                continue
            try:
                present = await self._tiers.dram.exists(keys)
            except Exception as exc:  # noqa: BLE001 - retried next pass; loads stay safe
                logger.warning("eviction sweep of %d keys failed: %s", len(keys), exc)
                continue
            gone = sweep.checked(keys, present)
            self._tiers.dram.stats.evictions_found = sweep.found_gone
            if gone:
                await self._publish([(OP_GONE, False, gone)])

    async def _publish(self, keys: IndexKeys | None) -> None:
        if self._index is not None and keys:
            sweep = self._index.sweep
            for op, lower, ks in keys:
                if sweep is not None and not lower:
                    (sweep.stored if op == OP_ADD else sweep.dropped)(list(ks))
            slot = self._store.rank
            changes = [
                self._index.changes(op, ks, slot if lower else None) for op, lower, ks in keys
            ]
            await self._index.publish(changes)

    async def reconcile_all(self) -> int:
        """Ask the backend about every DRAM key this client stored, over the sweep's next
        passes (the pool's server let a segment go); how many (0: no block index)."""
        if self._index is None or self._index.sweep is None:
            return 0
        self._ensure_background()
        return self._index.sweep.ask_all()

    async def probe(self) -> dict[str, Any]:
        self._ensure_background()
        return {
            "rank": self._store.rank,
            "pid": os.getpid(),
            "probe_hash": probe_hash(),
            "node_id": self._node_id,
        }

    async def channel(self) -> str:
        """The node channel's address; it listens from the first call on."""
        self._ensure_background()
        if self._channel is None:
            name = f"{self._config.name}-client{self._store.rank}"
            self._channel = ChannelServer(
                name, {"get": self.get, "put": self.put, "ping": self._ping}
            )
        return await self._channel.start()

    async def connect_keeper(self) -> None:
        """Connect to this node's block-index keeper before the first store needs it."""
        if self._index is not None:
            await self._index.connect()

    async def _ping(self) -> None:
        """A round trip with nothing to do (scripts/bench_channel.py)."""

    async def put(self, batch: TransferBatch, overwrite: bool = False) -> list[KeyStatus]:
        self._ensure_background()
        keys: IndexKeys | None = [] if self._index is not None else None
        statuses = await self._tiers.put(batch, overwrite, index=keys)
        await self._publish(keys)
        return statuses

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        keys: IndexKeys | None = [] if self._index is not None else None
        statuses = await self._tiers.get(batch, index=keys)
        await self._publish(keys)
        return statuses

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._tiers.exists(keys)

    async def dram_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether the pool's DRAM tier holds ``keys`` (not this node's SSD tier): the
        manager's check of what a lost node took with it."""
        return await self._tiers.dram.exists(keys)

    async def remove(self, keys: Sequence[str], force: bool = False) -> list[KeyStatus]:
        self._ensure_background()
        notes: IndexKeys | None = [] if self._index is not None else None
        statuses = await self._tiers.remove(keys, force, index=notes)
        await self._publish(notes)
        return statuses

    async def map_region(self, spec: RegionSpec) -> None:
        """Map (and register) a region before its first transfer: an engine calls this
        as it registers its KV cache, so mapping a large cache is paid at startup."""
        await self._tiers.map_region(spec)

    async def release_region(self, region_id: str) -> None:
        await self._tiers.release_region(region_id)

    async def health(self) -> bool:
        return await self._store.backend.health()

    async def snapshot(self) -> dict[str, Any]:
        return self._store.snapshot()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        for task in self._background:
            task.cancel()
        await self._store.close()
