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
one it applied, and the hub answers as soon as there are any from other nodes (a long
poll), so a store reaches the schedulers of the other nodes within two actor calls.

A keeper has its own node's changes already: the hub sends them back as markers (the
publisher and its count, not the keys), in the log's order, and never wakes a keeper for
them alone (they ride on the next update: another node's change or the poll's limit). A
keeper applies its own node's changes again at their markers, and after every update
until their marker came: a snapshot taken before the hub had one, or another node's older
change of the same keys, would otherwise erase it. A marker of a change the keeper never
got (its call failed) makes the keeper ask again for the same changes, whole. (Until the
stream catches up, an entry can be briefly older than the node's latest change: the index
is advisory, a stale hit a failed load.)

A keeper whose position the log no longer reaches (it fell behind, or the hub is a new
one after a manager restart: another ``epoch``) gets a snapshot instead: the hub's whole
index, its places, and the position after it.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvray.index.block_index import DRAM, GONE, REMOVED, BlockIndex
from kvray.index.long_poll import LongPoll

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
    origin: str = ""
    """The node whose pool actor made the change ("": the manager)."""
    source: str = ""
    """The publisher that made it (one per actor), and its count of changes made: the
    hub's marker for the keeper of ``origin``, which has the change already."""
    count: int = 0


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """What a keeper applies: the changes after its position (``op``, tier bits, digests),
    or, with ``snapshot``, everything: ``(digests, tier masks)`` in ``places``' bits."""

    epoch: str
    seq: int
    places: list[tuple[str, int]]
    changes: list[tuple[int, int, bytes, str, int]]
    """``(op, tier bits, digests, source, count)``; a change of the asking keeper's own
    node is a marker: no digests (the keeper has them)."""
    snapshot: tuple[bytes, bytes] | None = None


@dataclass(frozen=True, slots=True)
class _Logged:
    op: int
    bits: int
    digests: bytes
    origin: str
    source: str
    count: int


class IndexHub:
    """The pool manager's side: every change, applied to its own index and logged."""

    def __init__(self, capacity: int, log_digests: int = DEFAULT_LOG_DIGESTS) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self.index = BlockIndex.create(capacity, prefix="kvray-index-hub")
        self._log: deque[_Logged] = deque()
        self._base = 0
        """The position of ``_log[0]``."""
        self._logged = 0
        self._log_digests = log_digests
        self._poll = LongPoll()

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
            self._log.append(_Logged(c.op, bits, c.digests, c.origin, c.source, c.count))
            self._logged += len(d)
        while self._logged > self._log_digests and len(self._log) > 1:
            self._logged -= len(self._log.popleft().digests) // 8
            self._base += 1
        self._poll.changed()

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

    def _current(self, epoch: str, seq: int) -> bool:
        return epoch == self.epoch and self._base <= seq <= self.seq

    def since(self, epoch: str, seq: int, node: str = "") -> IndexUpdate:
        """What a keeper at ``seq`` of ``epoch`` lacks: the changes after it (those of
        its ``node`` as markers), or a snapshot."""
        places = self.index.places()
        if not self._current(epoch, seq):
            digests, tiers = self.index.entries()
            snap = (digests.astype("<u8").tobytes(), tiers.astype("<u4").tobytes())
            return IndexUpdate(self.epoch, self.seq, places, [], snap)
        changes = []
        for i in range(seq - self._base, len(self._log)):
            e = self._log[i]
            own = bool(node) and e.origin == node and bool(e.source)
            changes.append((e.op, e.bits, b"" if own else e.digests, e.source, e.count))
        return IndexUpdate(self.epoch, self.seq, places, changes)

    def _news(self, epoch: str, seq: int, node: str) -> bool:
        """Whether a keeper of ``node`` at ``seq`` lacks anything it does not have: a
        snapshot, or a change of another node."""
        if not self._current(epoch, seq):
            return True
        return any(
            self._log[i].origin != node or not self._log[i].source
            for i in range(seq - self._base, len(self._log))
        )

    async def wait(self, epoch: str, seq: int, wait_s: float, node: str = "") -> IndexUpdate:
        """:meth:`since`, once the keeper of ``node`` lacks something (:meth:`_news`) or
        ``wait_s`` passed (then with the markers of its own node's changes)."""
        await self._poll.wait(lambda: self._news(epoch, seq, node), wait_s)
        return self.since(epoch, seq, node)


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
        self._unconfirmed: deque[tuple[int, int, bytes, str, int]] = deque()
        """This node's changes applied here that the hub has not marked yet, in order
        (``(op, tier bits, digests, source, count)``): applied again after each update
        from the hub, which may carry older changes of the same keys (or a snapshot taken
        before the hub had them)."""
        self.lost = 0
        """Updates with a marker of a change this keeper never got."""
        self.whole = False
        """Ask the hub for the changes whole, markers none (the last update had a marker
        of a change this keeper never got: it asks again from the same position)."""

    def state(self) -> dict[str, int]:
        """Where this keeper is in the stream: its position, the snapshots it took, the
        markers it found no change for, and its node's changes still unmarked."""
        return {
            "seq": self.seq,
            "snapshots": self.snapshots,
            "lost": self.lost,
            "unmarked": len(self._unconfirmed) + len(self._waiting),
        }

    def apply_local(self, changes: list[IndexChange]) -> None:
        """Changes of this node's clients, as they make them. An SSD place the hub has not
        named yet has no bit here (bits are the hub's): its changes wait until it has."""
        for c in changes:
            bits = DRAM if c.slot < 0 else self.index.place_bit(c.node_id, c.slot, register=False)
            if bits and not (self._waiting and c.slot >= 0):
                apply(self.index, c.op, bits, np.frombuffer(c.digests, dtype="<u8"))
                self._unconfirmed.append((c.op, bits, c.digests, c.source, c.count))
                while len(self._unconfirmed) > UNCONFIRMED_MAX:
                    self._unconfirmed.popleft()
            else:  # (behind others waiting: in order)
                self._waiting.append(c)

    def _confirmed(self, op: int, raw: bytes, source: str, count: int) -> bytes | None:
        """The hub sent back one of this node's changes, whole or as a marker: taken off
        the pending ones; its digests, or None when this keeper never had it."""
        for i, (o, _, r, src, n) in enumerate(self._unconfirmed):
            if (src, n) == (source, count) if source else (o == op and r == raw):
                del self._unconfirmed[i]
                return r
        return None

    def _named(self) -> None:
        """Waiting changes whose SSD place the hub has named now join the unconfirmed
        ones (in order), before the hub's changes are matched against them: the update
        that named the place may carry them already."""
        waiting, self._waiting = self._waiting, []
        for c in waiting:
            bits = self.index.place_bit(c.node_id, c.slot, register=False)
            if bits and not self._waiting:
                self._unconfirmed.append((c.op, bits, c.digests, c.source, c.count))
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
        lost = False
        if update.snapshot is None:
            for op, bits, raw, source, count in update.changes:
                mine = self._confirmed(op, raw, source, count) if self._unconfirmed else None
                if not raw:  # a marker: this node's change, applied again in the log's order
                    if mine is None:
                        lost = True
                        continue
                    raw = mine
                apply(self.index, op, bits, np.frombuffer(raw, dtype="<u8"))
        # This node's newer changes win over what the hub sent (read your writes).
        for op, bits, raw, _, _ in self._unconfirmed:
            apply(self.index, op, bits, np.frombuffer(raw, dtype="<u8"))
        self.whole = lost
        if lost:  # a change of this node that never came here: the same changes again, whole
            self.lost += 1
        else:
            self.epoch, self.seq = update.epoch, update.seq
        self.index.touch()


def apply(index: BlockIndex, op: int, bits: int, digests: np.ndarray) -> None:
    if op == OP_ADD:
        index.add(digests, bits)
    else:
        index.remove(digests, bits, MARKER[op])
