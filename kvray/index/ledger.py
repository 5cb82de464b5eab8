"""The pool's memory of which blocks it stored: what tells a miss "never stored" from
"evicted" or "removed".

The backends forget a block without a trace when they evict it, so kvray keeps its own
record. Each BackendClient actor reports the blocks it stored and removed (a digest per
block, rank-agnostic: ``namespace``, ``layout`` and the block hash) to the pool manager
every :data:`FLUSH_S`; each Lookup actor follows the manager's record with a replica and
classifies its misses from it, without a call on the lookup path. The record is bounded
(the oldest blocks are forgotten first: a miss of a forgotten block counts as never
stored), and a block stored in the last flush interval may still read as never stored.
"""

from __future__ import annotations

import hashlib
from enum import IntEnum

from kvray.keys import block_of_key

FLUSH_S = 0.25
"""How often actors send (BackendClient) or fetch (Lookup) ledger updates, at most."""

LEDGER_WAIT_S = 2.0
"""How long the manager holds a Lookup actor's ask for ledger updates when it has none
(a long poll: an idle pool makes one such call per this interval, not one per
:data:`FLUSH_S`)."""

DEFAULT_CAPACITY = 1 << 18
"""Blocks remembered (~30 MB per holder); the oldest are forgotten first."""


class Seen(IntEnum):
    NEVER = 0
    STORED = 1
    REMOVED = 2
    """Removed through kvray (``Pool.remove``, ``kvray`` clearing a namespace)."""


def block_digest(key: str) -> int:
    """The block a key string belongs to, whatever its rank and layer group."""
    block = block_of_key(key).encode()
    return int.from_bytes(hashlib.blake2b(block, digest_size=8).digest(), "little")


Change = tuple[int, int, float]
"""``(digest, Seen, when)``: ``when`` (epoch seconds, taken by the actor that stored or
removed the block) orders the reports of different actors, which arrive in any order."""
Entries = list[Change]


class Ledger:
    """Block digest -> :class:`Seen`, at most ``capacity`` of them (insertion order: a
    block stored again moves to the end). The manager's ledger also keeps a change log
    that followers read with :meth:`since`; a follower applies them with :meth:`apply`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ledger capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._seen: dict[int, tuple[int, float]] = {}
        self._log: Entries = []
        self._log_base = 0
        """Sequence number of ``_log[0]``."""

    def __len__(self) -> int:
        return len(self._seen)

    def state(self, digest: int) -> Seen:
        got = self._seen.get(digest)
        return Seen.NEVER if got is None else Seen(got[0])

    def record(self, changes: Entries) -> None:
        self._set(changes)
        self._log.extend(changes)
        if len(self._log) > 2 * self.capacity:
            drop = len(self._log) - self.capacity
            del self._log[:drop]
            self._log_base += drop

    @property
    def seq(self) -> int:
        return self._log_base + len(self._log)

    def since(self, seq: int) -> tuple[int, Entries, bool]:
        """``(new seq, entries, full)``: the changes after ``seq``, or (``full``) the
        whole record when the log no longer reaches back that far."""
        if seq < self._log_base or seq > self.seq:
            return self.seq, [(d, s, t) for d, (s, t) in self._seen.items()], True
        return self.seq, self._log[seq - self._log_base :], False

    def apply(self, entries: Entries, full: bool) -> None:
        if full:
            self._seen.clear()
        self._set(entries)

    def _set(self, changes: Entries) -> None:
        seen = self._seen
        for d, s, t in changes:
            old = seen.pop(d, None)
            seen[d] = (s, t) if old is None or t >= old[1] else old
        while len(seen) > self.capacity:
            del seen[next(iter(seen))]
