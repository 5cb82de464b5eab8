"""The pool manager's watch for lost memory: the block index reconciled with each node Ray
no longer lists, once per node, and with each segment the pool's server let go.

A lost node takes with it the SSD tiers of its places (as far as the pool reaches them):
their entries leave the hub's index (:meth:`~kvray.index.stream.IndexHub.node_lost`). Its
DRAM copies went with its memory too, but the index cannot tell which of the pool's DRAM
blocks lived there, so, with the pool's KV events on, the blocks the events announce in
DRAM are asked of a client on a live node, and those the backend no longer holds are
recorded gone (the nodes' indexes and the events stop showing them). A backend may drop a
dead client's memory later than Ray declares its node dead, so the DRAM check runs again
:data:`NODE_RECHECK_S` later.

A live client's segment goes too: the Mooncake master drops a client that missed its
heartbeats for ``client_ttl`` (a stalled process on a busy host), with every object in its
segment, and the client mounts it again, empty, once it runs; a client closed or
restarted takes its segment with it. Nothing is evicted, so the eviction sweep's counter
does not move. The manager reads the embedded master's metrics every second
(:class:`SegmentLoss` says when they show a segment gone), and :meth:`NodeLossWatch.
segment_lost` then has every client on a live node ask the backend about every DRAM key
it stored (its sweep's next passes, which publish the gone ones), and does the DRAM check
of the announced blocks above.

Each step catches and logs its failure; the watch goes on (a reconcile loop). The manager
actor wires it to Ray (the alive nodes, its clients); here it needs none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

import numpy as np

from kvray.index.kv_events import CPU
from kvray.index.stream import OP_GONE, IndexChange, IndexHub

logger = logging.getLogger(__name__)

NODE_WATCH_S = 2.0
"""How often a manager with a block index looks for lost nodes."""
NODE_RECHECK_S = 30.0
"""A lost node's DRAM copies are checked again this long after the first check (a
backend may drop a dead client's memory later than Ray declares its node dead)."""
DRAM_CHECK_BATCH = 4096
"""Keys per ``dram_exists`` call of that check."""


class DramClient(Protocol):
    """A pool client that answers whether the DRAM tier holds keys (a BackendClient)."""

    def dram_exists(self, keys: list[str]) -> Awaitable[list[bool]]: ...

    def reconcile_all(self) -> Awaitable[int]:
        """Ask the backend about every DRAM key it stored and publish the gone ones (its
        eviction sweep); how many it will ask about."""
        ...


SEGMENT_METRICS = (
    "master_total_capacity_bytes",
    "master_active_clients",
    "master_mount_segment_requests_total",
    "master_remount_segment_requests_total",
    "master_unmount_segment_requests_total",
)
"""The Mooncake master's metrics :class:`SegmentLoss` reads."""


class SegmentLoss:
    """Whether a Mooncake master let a client's segment go between two reads of its
    metrics (:data:`SEGMENT_METRICS`): its capacity or its active clients fell (a client
    dropped after ``client_ttl``, or closed), a segment was unmounted, or a client
    mounted its segment again (a client dropped while it stalled; a new client counts a
    mount and a remount, measured on Mooncake 0.3, so only remounts beyond mounts)."""

    def __init__(self) -> None:
        self._last: dict[str, float] | None = None

    def seen(self, values: dict[str, float]) -> str | None:
        """Read ``values`` (a scrape); why a segment went since the last read, or None."""
        now = {k: values[k] for k in SEGMENT_METRICS if k in values}
        last, self._last = self._last, now

        def moved(key: str) -> float:
            return now[key] - last[key] if last is not None and key in now and key in last else 0

        if moved("master_total_capacity_bytes") < 0:
            return f"its capacity fell by {-int(moved('master_total_capacity_bytes'))} bytes"
        if moved("master_active_clients") < 0:
            return f"{-int(moved('master_active_clients'))} client(s) left"
        if moved("master_unmount_segment_requests_total") > 0:
            return "a client unmounted its segment"
        remounts = moved("master_remount_segment_requests_total")
        if remounts - moved("master_mount_segment_requests_total") > 0:
            return "a client mounted its segment again"
        return None


class AnnouncedBlocks(Protocol):
    """The pool's KV events (:class:`~kvray.index.kv_events.KVEventsHub`): the blocks they
    announce, and the index changes they publish."""

    def keys_in(self, medium: str) -> tuple[np.ndarray, list[str]]: ...

    def changed(self, digests: Iterable[np.ndarray]) -> None: ...


class NodeLossWatch:
    """Reconciles ``hub``'s index with each lost node.

    ``alive``: the cluster's alive nodes (node id -> address), asked each pass.
    ``clients``: the pool's clients by node, in the order to ask them (the first on a
    live node answers the DRAM check). ``events``: the pool's KV events (None: off, and
    no DRAM check: nothing says which DRAM blocks there are)."""

    def __init__(
        self,
        pool: str,
        hub: IndexHub,
        events: AnnouncedBlocks | None,
        alive: Callable[[], Awaitable[dict[str, str]]],
        clients: Callable[[], Sequence[tuple[str, DramClient]]],
        *,
        watch_s: float = NODE_WATCH_S,
        recheck_s: float = NODE_RECHECK_S,
        batch: int = DRAM_CHECK_BATCH,
    ) -> None:
        self._pool = pool
        self._hub = hub
        self._events = events
        self._alive = alive
        self._clients = clients
        self._watch_s = watch_s
        self._recheck_s = recheck_s
        self._batch = batch
        self.handled: set[str] = set()
        """Nodes found lost (each reconciled once)."""
        self._rechecks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            await asyncio.sleep(self._watch_s)
            await self.step()

    async def step(self) -> list[str]:
        """One pass: each node known to the pool (it has clients, or SSD places in the
        index) that is no longer alive and not yet handled is reconciled, and its DRAM
        recheck scheduled; returns those nodes."""
        try:
            alive = await self._alive()
        except Exception:
            logger.exception("pool %s: node watch pass failed (the alive nodes)", self._pool)
            return []
        known = {n for n, _ in self._clients()} | {n for n, _ in self._hub.index.places()}
        lost = sorted(known - set(alive) - self.handled)
        for node in lost:
            # Handled even when its reconcile fails: the SSD entries already went with
            # node_lost's record, and the recheck below asks about the DRAM ones again.
            self.handled.add(node)
            try:
                await self.node_lost(node, alive)
            except Exception:
                logger.exception("pool %s: reconciling lost node %s failed", self._pool, node[:12])
            if self._events is not None:
                task = asyncio.get_running_loop().create_task(self._recheck_later(node))
                self._rechecks.add(task)
                task.add_done_callback(self._rechecks.discard)
        return lost

    async def node_lost(self, node: str, alive: dict[str, str]) -> None:
        """``node``'s SSD places leave the index; the announced DRAM blocks are checked."""
        changes = self._hub.node_lost(node)
        ssd = sum(len(c.digests) // 8 for c in changes)
        if self._events is not None and changes:
            self._events.changed([np.frombuffer(c.digests, dtype="<u8") for c in changes])
        dram = await self.drop_gone_dram(alive)
        logger.warning(
            "pool %s: node %s lost: %d entries of its SSD tiers left the block index; %d "
            "announced DRAM keys found gone",
            self._pool, node[:12], ssd, dram,
        )  # fmt: skip

    async def segment_lost(self, why: str) -> tuple[int, int]:
        """The server let a segment go (``why``, :class:`SegmentLoss`): every client on a
        live node asks the backend about every DRAM key it stored, and the announced DRAM
        blocks are checked; returns (keys the clients will ask about, announced keys
        found gone)."""
        alive = await self._alive()
        asks = [c.reconcile_all() for node, c in self._clients() if node in alive]
        asked = 0
        for answer in await asyncio.gather(*asks, return_exceptions=True):
            if isinstance(answer, BaseException):
                logger.warning("pool %s: a client did not take the ask to reconcile: %s",
                               self._pool, answer)  # fmt: skip
            else:
                asked += answer
        dram = await self.drop_gone_dram(alive)
        logger.warning(
            "pool %s: the server let a segment go (%s): the clients ask about the %d DRAM "
            "keys they stored; %d announced DRAM keys found gone",
            self._pool, why, asked, dram,
        )  # fmt: skip
        return asked, dram

    async def _recheck_later(self, node: str) -> None:
        await asyncio.sleep(self._recheck_s)
        await self.recheck(node)

    async def recheck(self, node: str) -> int:
        """The DRAM check again, after ``node`` was lost; how many more keys were gone."""
        try:
            dram = await self.drop_gone_dram(await self._alive())
        except Exception:
            logger.exception("pool %s: DRAM recheck after node %s failed", self._pool, node[:12])
            return 0
        if dram:
            logger.warning("pool %s: %d more DRAM keys found gone after node %s was lost",
                           self._pool, dram, node[:12])  # fmt: skip
        return dram

    async def drop_gone_dram(self, alive: dict[str, str]) -> int:
        """The DRAM keys of the blocks the pool's events announce that the backend no
        longer holds, recorded gone (published removed); how many. Asked of the first
        client on a live node, in batches."""
        if self._events is None:
            return 0
        digests, keys = self._events.keys_in(CPU)
        client = next((c for node, c in self._clients() if node in alive), None)
        if not keys or client is None:
            return 0
        present: list[bool] = []
        for i in range(0, len(keys), self._batch):
            batch = keys[i : i + self._batch]
            answer = await client.dram_exists(batch)
            if len(answer) != len(batch):
                raise RuntimeError(
                    f"dram_exists answered {len(answer)} of {len(batch)} keys (the client's bug)"
                )
            present += answer
        gone = digests[~np.asarray(present, dtype=bool)]
        if len(gone):
            self._hub.record([IndexChange(OP_GONE, gone.astype("<u8").tobytes())])
            self._events.changed([gone])
        return len(gone)

    def close(self) -> None:
        """Cancel the pending rechecks."""
        for task in list(self._rechecks):
            task.cancel()
