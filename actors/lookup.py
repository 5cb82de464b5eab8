"""Lookup actor: prefix lookups for the schedulers of one node (every rank of an
instance at once), through a client that stores nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvray import remote
from kvray.actors.node_config import current_settings, on_this_node
from kvray.backends import make_backend
from kvray.config import PoolConfig
from kvray.errors import KVRayError
from kvray.index.block_index import BlockIndex, IndexSpec
from kvray.index.ledger import FLUSH_S, LEDGER_WAIT_S, Ledger
from kvray.index.lookup import Answer, LookupService, Place, Placement
from kvray.index.stream import FIRST_SYNC_WAIT_S, INDEX_POLL_S, IndexChange, IndexKeeper
from kvray.keys import KeySpace, probe_hash
from kvray.metrics import export_forever
from kvray.naming import client_name, ssd_name
from kvray.ray_env import normal_priority
from kvray.remote import ManagerHandle, ManagerLink, Remake, StoreHandle
from kvray.stats import RankStats
from kvray.store.channel import ChannelServer


class LookupActor:
    def __init__(self, config_json: str, server_address: str, remake: Remake | None = None) -> None:
        """``remake``: how to make the pool's manager again (:class:`ManagerLink`)."""
        logging.basicConfig(level=logging.INFO)
        normal_priority("Lookup actor")
        config_json, server_address = current_settings(config_json, server_address)
        config = on_this_node(PoolConfig.model_validate_json(config_json))
        self._node_id = remote.node_id()
        self._config = config
        self._remake = remake
        lower = self._ssd_exists if config.ssd_tier else None
        backend = make_backend(config, server_address, contribute_memory=False)
        self._service = LookupService(backend, lower, Ledger(), self._node_id)
        self._ssd: dict[Place, StoreHandle] = {}
        """SSD offload actors asked so far, by node and slot (any node's: a rank's worker
        may run on another node than this scheduler)."""
        self._follower: asyncio.Task[None] | None = None
        self._exporter: asyncio.Task[None] | None = None
        self._keeper: IndexKeeper | None = None
        """The node's block index, which this actor keeps and the node's schedulers read
        (``lookup_index``)."""
        if config.lookup_index:
            index = BlockIndex.create(config.lookup_index_blocks)
            self._keeper = IndexKeeper(index)
        self._index_task: asyncio.Task[None] | None = None
        self._channel: ChannelServer | None = None
        """The node channel this node's clients send their index changes on."""
        self._channel_applies = 0
        """Index changes received over it (the rest came as Ray calls)."""
        self._synced = asyncio.Event()
        """Set once the keeper applied the manager's first update."""

    def _ensure_follower(self) -> None:
        # Started from the first async call: __init__ runs before the actor's loop does.
        if self._follower is None:
            loop = asyncio.get_running_loop()
            self._follower = loop.create_task(self._follow_ledger())
            self._exporter = loop.create_task(
                export_forever(self._config.name, "lookup", None, self._metrics)
            )
            if self._keeper is not None:
                self._index_task = loop.create_task(self._follow_index(self._keeper))

    async def _metrics(self) -> tuple[RankStats, int | None]:
        return self._service.stats, None

    async def _follow_ledger(self) -> None:
        """Follow the manager's ledger (what tells an evicted block from one never
        stored): a long poll the manager answers once it has changes, at most one call
        every FLUSH_S, never on a lookup's path."""
        manager = ManagerLink(
            self._config,
            "Lookup",
            "misses read as never stored until it answers",
            remake=self._remake,
        )
        wait_s = min(LEDGER_WAIT_S, self._config.call_timeout_s / 2)
        seq = 0
        while True:
            await asyncio.sleep(FLUSH_S)
            update = await manager.call(partial(ManagerHandle.ledger_since, seq=seq, wait_s=wait_s))
            if update is None:
                continue
            seq, entries, full, mixed = update
            self._service.ledger.apply(entries, full)  # type: ignore[union-attr]
            self._service.mixed_hashing = set(mixed)

    async def _follow_index(self, keeper: IndexKeeper) -> None:
        """Keep the node's block index to the manager's stream: a long poll answered as
        soon as a client of another node reports a store or remove (this node's come as
        markers). While the manager does not answer,
        the index ages and the schedulers stop trusting its misses (``INDEX_STALE_S``)."""
        manager = ManagerLink(
            self._config, "Lookup", "the node's block index goes stale (lookups ask this actor)"
        )
        while True:
            update = await manager.call(
                partial(ManagerHandle.index_since, epoch=keeper.epoch, seq=keeper.seq,
                        wait_s=INDEX_POLL_S, node="" if keeper.whole else self._node_id)
            )  # fmt: skip
            if update is None:
                await asyncio.sleep(FLUSH_S)
                continue
            keeper.apply(update)
            self._synced.set()

    async def index_apply(self, changes: list[IndexChange]) -> None:
        """This node's clients' changes, as they make them."""
        if self._keeper is not None:
            self._keeper.apply_local(changes)

    async def _index_apply_by_channel(self, changes: list[IndexChange]) -> None:
        self._channel_applies += len(changes)
        await self.index_apply(changes)

    async def channel(self) -> str:
        """The address of this actor's node channel (:mod:`kvray.store.channel`), on
        which the node's clients send their index changes without a Ray round trip (a
        store's change is applied before the store returns: it is on the path of a
        lookup waiting for that store)."""
        if self._channel is None:
            self._channel = ChannelServer(
                f"{self._config.name}-lookup", {"index_apply": self._index_apply_by_channel}
            )
        return await self._channel.start()

    async def index_spec(self) -> IndexSpec | None:
        """Asked by a scheduler as it attaches: the node's clients connect to this keeper
        first, so their first store's read-your-writes is not paid as a lookup waits for
        it (BackendClient.connect_keeper), and the keeper has the pool's stream (for at
        most FIRST_SYNC_WAIT_S: past it the index reads as stale until it has), so the
        first requests' lookups are answered from the index like the later ones."""
        self._ensure_follower()
        if self._keeper is None:
            return None
        cfg = self._config
        names = [client_name(cfg.name, self._node_id, s) for s in range(cfg.world_size)]
        found = await asyncio.to_thread(lambda: [remote.find(n, cfg.namespace) for n in names])
        calls = [StoreHandle(a, n).connect_keeper() for a, n in zip(found, names, strict=True) if a]
        with contextlib.suppress(KVRayError):  # a client gone meanwhile connects later
            await asyncio.gather(*(c.aresult(self._config.call_timeout_s) for c in calls))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), FIRST_SYNC_WAIT_S)
        return self._keeper.index.spec

    async def _ssd_exists(self, place: Place, keys: list[str]) -> list[bool]:
        """The SSD tier of slot ``place.slot`` on node ``place.node_id`` (SSD blocks live
        on the disk of the node that wrote them; another node's tier is a Ray call away,
        on the SSD fallback path only)."""
        handle = self._ssd.get(place)
        if handle is None:
            name = ssd_name(self._config.name, place.node_id, place.slot)
            actor = await asyncio.to_thread(remote.find, name, self._config.namespace)
            if actor is None:  # no worker of that slot ever ran there: nothing on disk
                return [False] * len(keys)
            name = f"SsdOffload[{place.slot}]@{place.node_id[:8]}"
            handle = self._ssd[place] = StoreHandle(actor, name)
        try:
            return await handle.exists(keys).aresult(self._config.call_timeout_s)
        except KVRayError:
            # Gone (its node died, the pool went down): found by name again next time.
            self._ssd.pop(place, None)
            raise

    async def probe(self) -> dict[str, Any]:
        self._ensure_follower()
        return {"node_id": self._node_id, "pid": os.getpid(), "probe_hash": probe_hash()}

    async def lookup(
        self,
        space: KeySpace,
        hashes: Sequence[bytes],
        timeout_s: float,
        want: int = 0,
        wait_s: float = 0.0,
        placement: Placement | None = None,
    ) -> Answer:
        self._ensure_follower()
        return await self._service.lookup(space, hashes, timeout_s, want, wait_s, placement)

    async def pin(self, space: KeySpace, hashes: Sequence[bytes], timeout_s: float) -> None:
        await self._service.pin(space, hashes, timeout_s)

    async def report(self, counts: dict[str, int]) -> None:
        """The lookups a scheduler's block index answered, counted as this actor's."""
        self._ensure_follower()
        self._service.count(counts)

    async def snapshot(self) -> dict[str, Any]:
        keeper = self._keeper
        return {
            "node_id": self._node_id,
            "stats": self._service.stats.to_dict(),
            "ssd_asks": [[p.node_id, p.slot, n] for p, n in self._service.ssd_asks.items()],
            # the node's block index as the pool's stream keeps it (None: no index)
            "index": None if keeper is None else keeper.state(),
            "index_channel_applies": self._channel_applies,
        }

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        if self._index_task is not None:
            self._index_task.cancel()
        if self._keeper is not None:
            self._keeper.index.close()
        await self._service.backend.close()
