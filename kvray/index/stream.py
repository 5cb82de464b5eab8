"""The stream that keeps every node's block index current: each key a pool client stored
or removed, and in which tier, pushed through the pool manager to the index keeper of
every node (kvray/index/block_index.py has the index).

Sources: each BackendClient reports its stores and removes as it makes them, as digests
of the keys with the tier that took them: the pool's DRAM tier, or the SSD tier of the
client's node and slot. First to its own node's keeper, before the call that stored them
returns (so a scheduler on that node reads what the node stored as soon as the store is
done), then to the manager (one report in flight; what arrives meanwhile goes in the
next). The manager's :class:`IndexHub` applies them to its own copy of the index and
appends them to a bounded log. Each node's keeper asks for the changes after the last
one it applied, and the hub answers as soon as there are any (a long poll), so a store
reaches the schedulers of the other nodes within two actor calls. A keeper applies its own
node's changes again when they come from the hub: a snapshot taken before the hub had one
would otherwise erase it for good. (Until the stream catches up, an entry can be briefly
older than the node's latest change: the index is advisory, a stale hit a failed load.)

A keeper whose position the log no longer reaches (it fell behind, or the hub is a new
one after a manager restart: another ``epoch``) gets a snapshot instead: the hub's whole
index, its places, and the position after it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvray.index.block_index import DRAM, GONE, REMOVED, BlockIndex

OP_ADD, OP_REMOVE, OP_GONE = 1, 2, 3
"""What a change does: a tier took keys; kvray removed them (``Pool.remove``: marker
:data:`~kvray.index.block_index.REMOVED`); a load or an eviction found them gone (marker
:data:`~kvray.index.block_index.GONE`)."""
MARKER = {OP_REMOVE: REMOVED, OP_GONE: GONE}

INDEX_POLL_S = 1.0
"""A keeper's long poll returns after this long with nothing new (and the index is then
marked current)."""
INDEX_STALE_S = 5.0
"""An index whose keeper was last current longer ago is not trusted (its misses are
asked of the Lookup actor): the manager or the keeper is gone or stuck."""
FIRST_SYNC_WAIT_S = 10.0
"""A scheduler attaching to a node's index waits at most this long for the keeper's first
update from the pool's stream (the index is stale until then, and lookups ask the Lookup
actor): a loaded host can take seconds to make the keeper's first call to the manager."""

DEFAULT_LOG_DIGESTS = 1 << 22
"""Digests the hub's log keeps (32 MiB): a keeper further behind gets a snapshot."""


@dataclass(frozen=True, slots=True)
class IndexChange:
    """Keys (their :func:`~kvray.index.block_index.key_digests`, little-endian uint64) that
    one tier took (``OP_ADD``) or let go (``OP_REMOVE``, ``OP_GONE``): the DRAM tier
    (``slot`` -1), or the SSD tier of ``node_id``'s ``slot``."""

    op: int
    digests: bytes
    node_id: str = ""
    slot: int = -1


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """What a keeper applies: the changes after its position (``op``, tier bits, digests),
    or, with ``snapshot``, everything: ``(digests, tier masks)`` in ``places``' bits."""

    epoch: str
    seq: int
    places: list[tuple[str, int]]
    changes: list[tuple[int, int, bytes]]
    """``(op, tier bits, digests)``."""
    snapshot: tuple[bytes, bytes] | None = None


class IndexHub:
    """The pool manager's side: every change, applied to its own index and logged."""

    def __init__(self, capacity: int, log_digests: int = DEFAULT_LOG_DIGESTS) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self.index = BlockIndex.create(capacity, prefix="kvray-index-hub")
        self._log: deque[tuple[int, int, bytes]] = deque()
        self._base = 0
        """The position of ``_log[0]``."""
        self._logged = 0
        self._log_digests = log_digests
        self._changed: asyncio.Event | None = None

    @property
    def seq(self) -> int:
        return self._base + len(self._log)

    def record(self, changes: list[IndexChange]) -> None:
        for c in changes:
            bits = DRAM if c.slot < 0 else self.index.place_bit(c.node_id, c.slot)
            if not bits:  # a place past the index's limit: its blocks read as misses
                continue
            d = np.frombuffer(c.digests, dtype="<u8")
            apply(self.index, c.op, bits, d)
            self._log.append((c.op, bits, c.digests))
            self._logged += len(d)
        while self._logged > self._log_digests and len(self._log) > 1:
            _, _, gone = self._log.popleft()
            self._logged -= len(gone) // 8
            self._base += 1
        if self._changed is not None:
            self._changed.set()

    def node_lost(self, node_id: str) -> list[IndexChange]:
        """``node_id`` is gone, and the SSD tiers of its places with it (as far as the
        pool reaches them): every entry's bit of those places let go, as a load finding
        them gone would (marker ``GONE``: a lookup misses them as ``evicted``). Recorded
        and returned (the pool's events drop them from ``STORAGE``)."""
        digests, tiers = self.index.entries()
        changes = []
        for node, slot in self.index.places():
            if node != node_id:
                continue
            bit = self.index.place_bit(node, slot, register=False)
            held = digests[(tiers & np.uint32(bit)) != 0]
            if len(held):
                changes.append(IndexChange(OP_GONE, held.astype("<u8").tobytes(), node, slot))
        self.record(changes)
        return changes

    def since(self, epoch: str, seq: int) -> IndexUpdate:
        places = self.index.places()
        if epoch != self.epoch or not self._base <= seq <= self.seq:
            digests, tiers = self.index.entries()
            snap = (digests.astype("<u8").tobytes(), tiers.astype("<u4").tobytes())
            return IndexUpdate(self.epoch, self.seq, places, [], snap)
        changes = [self._log[i] for i in range(seq - self._base, len(self._log))]
        return IndexUpdate(self.epoch, self.seq, places, changes)

    async def wait(self, epoch: str, seq: int, wait_s: float) -> IndexUpdate:
        """:meth:`since`, once there is something after ``seq`` or ``wait_s`` passed."""
        if self._changed is None:
            self._changed = asyncio.Event()
        while epoch == self.epoch and seq == self.seq:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                break
        return self.since(epoch, seq)


UNCONFIRMED_MAX = 4096
"""Local changes a keeper keeps to re-apply until the hub sends them back (more: the hub
is unreachable, and the oldest are dropped; the index is advisory)."""


class IndexKeeper:
    """A node's side: the index the node's schedulers read, kept to the hub's updates and,
    first, to its own node's clients' changes (:meth:`apply_local`)."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.epoch = ""
        self.seq = 0
        self.snapshots = 0
        self._waiting: list[IndexChange] = []
        """Changes of this node's clients in an SSD place the hub has not named yet."""
        self._unconfirmed: deque[tuple[int, int, bytes]] = deque()
        """This node's changes applied here that the hub has not sent back yet, in order:
        applied again after each update from the hub, which may carry older changes of
        the same keys (or a snapshot taken before the hub had them)."""

    def apply_local(self, changes: list[IndexChange]) -> None:
        """Changes of this node's clients, as they make them. An SSD place the hub has not
        named yet has no bit here (bits are the hub's): its changes wait until it has."""
        for c in changes:
            bits = DRAM if c.slot < 0 else self.index.place_bit(c.node_id, c.slot, register=False)
            if bits and not (self._waiting and c.slot >= 0):
                apply(self.index, c.op, bits, np.frombuffer(c.digests, dtype="<u8"))
                self._unconfirmed.append((c.op, bits, c.digests))
                while len(self._unconfirmed) > UNCONFIRMED_MAX:
                    self._unconfirmed.popleft()
            else:  # (behind others waiting: in order)
                self._waiting.append(c)

    def _confirmed(self, op: int, raw: bytes) -> None:
        """The hub sent back one of this node's changes (the first equal one pending)."""
        for i, (o, _, r) in enumerate(self._unconfirmed):
            if o == op and r == raw:
                del self._unconfirmed[i]
                return

    def _named(self) -> None:
        """Waiting changes whose SSD place the hub has named now join the unconfirmed
        ones (in order), before the hub's changes are matched against them: the update
        that named the place may carry them already."""
        waiting, self._waiting = self._waiting, []
        for c in waiting:
            bits = self.index.place_bit(c.node_id, c.slot, register=False)
            if bits and not self._waiting:
                self._unconfirmed.append((c.op, bits, c.digests))
            else:
                self._waiting.append(c)

    def apply(self, update: IndexUpdate) -> None:
        if update.snapshot is not None:
            digests = np.frombuffer(update.snapshot[0], dtype="<u8")
            tiers = np.frombuffer(update.snapshot[1], dtype="<u4")
            self.index.reset(update.places, digests, tiers)
            self.snapshots += 1
        else:
            # New places since: registered in the hub's order, so the bits are the hub's.
            for node_id, slot in update.places[len(self.index.places()) :]:
                self.index.place_bit(node_id, slot)
        if self._waiting:
            self._named()
        if update.snapshot is None:
            for op, bits, raw in update.changes:
                apply(self.index, op, bits, np.frombuffer(raw, dtype="<u8"))
                if self._unconfirmed:
                    self._confirmed(op, raw)
        # This node's newer changes win over what the hub sent (read your writes).
        for op, bits, raw in self._unconfirmed:
            apply(self.index, op, bits, np.frombuffer(raw, dtype="<u8"))
        self.epoch, self.seq = update.epoch, update.seq
        self.index.touch()


def apply(index: BlockIndex, op: int, bits: int, digests: np.ndarray) -> None:
    if op == OP_ADD:
        index.add(digests, bits)
    else:
        index.remove(digests, bits, MARKER[op])
