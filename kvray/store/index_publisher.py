"""A pool actor's side of the block-index stream (kvray/index/stream.py): it hands the
changes it makes to its node's index keeper before the call that made them returns, and
queues them for the manager's hub, for the other nodes.

The keeper takes them on its node channel (:mod:`kvray.store.channel`, a Unix socket on
the node; measured: a store's hand-over took 3.1-4.4 ms as a Ray call while a lookup
waited for it), Ray calls being the fallback while the channel is down.

Used by the BackendClient (what each tier stored, removed, or a load found gone) and by
the SSD offload actor (what its quota evicted, and what it holds at start).

The DRAM backends evict without telling anyone, so each BackendClient also reconciles
what it stored (:class:`EvictionSweep`): when the pool's server reports evictions (the
Mooncake master's ``evicted_key_count``, read by the manager and returned with each
report to the hub; a client that sent none for :data:`SWEEP_IDLE_S` asks for it), or every
:data:`SWEEP_S` where no counter is known, it asks the
backend about its oldest stored keys (at most :data:`SWEEP_MAX` per pass, one batched
``exists``) and publishes those gone. A block evicted and not yet swept is a stale hit:
a failed load, recomputed and counted ``gone_at_load``, never wrong bytes. (Mooncake's
``exists`` grants a read lease, so a key a pass finds is not evicted for the master's
``default_kv_lease_ttl_ms``.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from functools import partial

from kvray import remote
from kvray.config import PoolConfig
from kvray.errors import KVRayError
from kvray.index.block_index import key_digests
from kvray.index.stream import IndexChange
from kvray.naming import lookup_name
from kvray.remote import LookupHandle, ManagerHandle, ManagerLink
from kvray.store.channel import ChannelLink
from kvray.warn_once import WarnOnce

logger = logging.getLogger(__name__)

KEEPER_RETRY_S = 5.0
"""How long a publisher waits before it looks for its node's index keeper again."""
SWEEP_S = 1.0
"""How often a BackendClient may reconcile its stored keys with the backend."""
SWEEP_MAX = 4096
"""Keys one pass asks about (one batched ``exists``)."""
SWEEP_BLIND = 512
"""Keys a pass asks about where the server's eviction counter is unknown (an external
server the manager does not read)."""
SWEEP_IDLE_S = 5.0
"""A BackendClient whose reports to the hub carried no eviction counter for this long (it
stored nothing meanwhile) asks the manager for it, at most this often, while it remembers
keys: another client's stores may be evicting them."""
SWEEP_KEPT = 1 << 18
"""Stored keys a BackendClient remembers for the sweep (about 100 bytes each); older ones
are no longer reconciled (a stale hit is still only a failed load)."""


class EvictionSweep:
    """The DRAM keys one BackendClient stored, oldest first, and which of them a pass
    asks the backend about."""

    def __init__(self, kept: int = SWEEP_KEPT) -> None:
        self._keys: dict[str, None] = {}
        self._kept = kept
        self._evicted: int | None = None
        """The server's eviction counter at the last pass (None: not known)."""
        self.seen_evicted: int | None = None
        """The latest counter the manager reported."""
        self._all_left = 0
        """Keys still to ask about in a pass over all of them (:meth:`ask_all`)."""
        self.swept = 0
        self.found_gone = 0

    def __len__(self) -> int:
        return len(self._keys)

    def stored(self, keys: list[str]) -> None:
        for key in keys:
            self._keys.pop(key, None)
            self._keys[key] = None
        while len(self._keys) > self._kept:
            del self._keys[next(iter(self._keys))]

    def dropped(self, keys: list[str]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def ask_all(self) -> int:
        """Ask about every key kept, :data:`SWEEP_MAX` per pass from the next one on (the
        server let a segment go: its blocks are gone whatever their age); how many."""
        self._all_left = len(self._keys)
        return self._all_left

    def due(self) -> list[str]:
        """The oldest keys to ask about now. In a pass over all of them
        (:meth:`ask_all`), the next :data:`SWEEP_MAX`. Else as many as the server
        evicted since the last pass, four times over (it evicts across every client's
        keys), at least 256 and at most :data:`SWEEP_MAX`; :data:`SWEEP_BLIND` when the
        counter is unknown; none when it did not move. The first counter seen counts
        from 0: the keys stored before it was read may be among what it counts."""
        if self._all_left > 0:
            # (Each pass moves the keys still there to the back: the oldest are the next.)
            n = min(SWEEP_MAX, self._all_left, len(self._keys))
            self._all_left = 0 if n == 0 else self._all_left - n
            return list(itertools.islice(self._keys, n))
        now = self.seen_evicted
        if now is None:
            n = SWEEP_BLIND
        else:
            moved = now - (self._evicted if self._evicted is not None else 0)
            self._evicted = now
            if moved <= 0:
                return []
            n = min(SWEEP_MAX, max(256, 4 * moved))
        return list(itertools.islice(self._keys, n))

    def checked(self, keys: list[str], present: list[bool]) -> list[str]:
        """After a pass: the keys gone are forgotten (and returned), the ones still there
        go to the back, so the next pass asks about others."""
        gone = [k for k, p in zip(keys, present, strict=True) if not p]
        self.dropped(keys)
        self.stored([k for k, p in zip(keys, present, strict=True) if p])
        self.swept += len(keys)
        self.found_gone += len(gone)
        return gone


class IndexPublisher:
    """One actor's changes to the pool's block indexes; :meth:`run` is its background
    task (sends to the hub), :meth:`publish` is awaited by the call that made them."""

    def __init__(self, config: PoolConfig, node_id: str, who: str) -> None:
        self._config = config
        self.node_id = node_id
        self._who = who
        self._source = uuid.uuid4().hex[:16]
        """This publisher, as the hub's markers name it to this node's keeper."""
        self._count = itertools.count(1)
        self._for_hub: list[IndexChange] = []
        self._hub_ready = asyncio.Event()
        self._keeper: LookupHandle | None = None
        self._keeper_retry_at = 0.0
        self._link: ChannelLink | None = None
        """The keeper's node channel (while it is down: Ray calls)."""
        self._channel_lock = asyncio.Lock()
        """One change in flight on the channel at a time (one waiter reads its answers)."""
        self._warn = WarnOnce(logger)
        self.sweep: EvictionSweep | None = None
        """A BackendClient's reconcile of its stored keys (set by it)."""
        self._manager: ManagerLink | None = None
        self._heard_at = time.monotonic()
        """When the server's eviction counter last came (a report's answer, or asked)."""

    def _manager_link(self) -> ManagerLink:
        if self._manager is None:
            self._manager = ManagerLink(
                self._config, self._who, "other nodes' block indexes miss it"
            )
        return self._manager

    async def hear_evictions(self) -> None:
        """An idle publisher's eviction counter (:data:`SWEEP_IDLE_S`): asked of the
        manager when no report brought it for that long and the sweep remembers keys."""
        sweep = self.sweep
        if sweep is None or not len(sweep) or time.monotonic() - self._heard_at < SWEEP_IDLE_S:
            return
        self._heard_at = time.monotonic()
        metrics = await self._manager_link().call(ManagerHandle.server_metrics)
        evicted = (metrics or {}).get("master_evicted_key_count")
        if evicted is not None:
            sweep.seen_evicted = int(evicted)

    def changes(self, op: int, keys: list[str], slot: int | None = None) -> IndexChange:
        """``keys`` that the DRAM tier (``slot`` None) or this node's SSD tier of ``slot``
        took or let go (``op``)."""
        digests = key_digests(keys).astype("<u8").tobytes()
        place, at = ("", -1) if slot is None else (self.node_id, slot)
        return IndexChange(op, digests, place, at, self.node_id, self._source, next(self._count))

    async def run(self) -> None:
        """Send what was published to the manager's hub: one report in flight, what comes
        meanwhile goes in the next."""
        manager = self._manager_link()
        while True:
            await self._hub_ready.wait()
            self._hub_ready.clear()
            changes, self._for_hub = self._for_hub, []
            if changes:
                evicted = await manager.call(partial(ManagerHandle.index_record, changes=changes))
                if self.sweep is not None and evicted is not None:
                    self.sweep.seen_evicted = evicted
                    self._heard_at = time.monotonic()

    async def connect(self) -> None:
        """Find this node's keeper now and make the first call to it (its node channel, or
        Ray's connection to it), so that the first store pays for neither before it
        returns: a scheduler's
        read-your-writes waits for it (measured: up to 550 ms on a busy 2-core host, more
        than a lookup waits for a save in flight). Asked by the node's Lookup actor as a
        scheduler attaches."""
        self._keeper_retry_at = 0.0
        if self._link is not None:
            self._link.ask_now()
        keeper = await self._find_keeper()
        if keeper is not None:
            try:
                if not await self._by_channel(keeper, []):
                    await keeper.index_apply([]).aresult(self._config.call_timeout_s)
            except KVRayError:
                self._lose_keeper()

    async def publish(self, changes: list[IndexChange]) -> None:
        """Applied by this node's keeper before this returns (what a scheduler on this node
        reads next includes them), then queued for the hub. A keeper that cannot be
        reached is looked for again after a pause; meanwhile the hub's marker of a change
        it lacks makes it ask for a snapshot."""
        if not changes:
            return
        try:
            keeper = await self._find_keeper()
            if keeper is not None and not await self._by_channel(keeper, changes):
                await keeper.index_apply(changes).aresult(self._config.call_timeout_s)
        except KVRayError as exc:
            self._lose_keeper()
            self._warn("keeper", "kvray %s: this node's block index did not take a change (%s); "
                       "it gets it from the pool's stream", self._who, exc)  # fmt: skip
        finally:
            # After the keeper has them: the hub's markers of them must find them there.
            self._for_hub.extend(changes)
            self._hub_ready.set()

    def _lose_keeper(self) -> None:
        """The keeper did not take a change: look for it (and its channel) again after a
        pause."""
        self._keeper, self._keeper_retry_at = None, time.monotonic() + KEEPER_RETRY_S
        if self._link is not None:
            self._link.close()
            self._link = None

    async def _by_channel(self, keeper: LookupHandle, changes: list[IndexChange]) -> bool:
        """Hand ``changes`` to the keeper on its node channel; False when the channel is
        not up (then the caller sends them as a Ray call). A channel that broke (the
        keeper restarted) is asked for again after :data:`KEEPER_RETRY_S`."""
        async with self._channel_lock:
            if self._link is None:
                self._link = ChannelLink(keeper.channel, f"{keeper.name} (index)", KEEPER_RETRY_S)
            channel = await self._link.alive(self._config.call_timeout_s)
            if channel is None:
                return False
            call = channel.call("index_apply", (changes,), f"{self._who} index_apply")
            channel.flush()
            try:
                await call.aresult(self._config.call_timeout_s)
            except KVRayError:
                if channel.broken is None:
                    raise  # the keeper answered with a failure, or not in time
                return False  # the channel broke: the caller's Ray call says the rest
            return True

    async def _find_keeper(self) -> LookupHandle | None:
        if self._keeper is None and time.monotonic() >= self._keeper_retry_at:
            name = lookup_name(self._config.name, self.node_id)
            actor = await asyncio.to_thread(remote.find, name, self._config.namespace)
            if actor is None:  # no scheduler on this node asked for one yet
                self._keeper_retry_at = time.monotonic() + KEEPER_RETRY_S
                return None
            self._keeper = LookupHandle(actor, f"Lookup@{self.node_id[:8]}")
        return self._keeper
