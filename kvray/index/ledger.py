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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

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


@dataclass(frozen=True, slots=True, eq=False)
class Changes:
    """Blocks stored or removed, in columns: ``digests`` (uint64, :func:`block_digest`),
    ``seen`` (uint8, :class:`Seen`) and ``when`` (float64 epoch seconds, taken by the actor
    that stored or removed the block: it orders the reports of different actors, which
    arrive in any order). Three arrays cross a Ray call as buffers, where a list of
    tuples costs each end microseconds per block (measured on 2 cores, Ray call p50: 1000
    blocks 2.0 ms as columns against 6.7 ms as tuples, 1.5 ms empty; a Lookup actor's
    first read of a ledger of 100k blocks 5.5 ms against 271 ms)."""

    digests: np.ndarray
    seen: np.ndarray
    when: np.ndarray

    @classmethod
    def of(cls, digests: Sequence[int], seen: int, when: float) -> Changes:
        """``digests``, all ``seen`` at ``when``."""
        n = len(digests)
        return cls(
            np.fromiter(digests, dtype=np.uint64, count=n),
            np.full(n, int(seen), dtype=np.uint8),
            np.full(n, when, dtype=np.float64),
        )

    @classmethod
    def rows_of(cls, rows: Sequence[tuple[int, int, float]]) -> Changes:
        """From ``(digest, seen, when)`` rows."""
        n = len(rows)
        return cls(
            np.fromiter((r[0] for r in rows), dtype=np.uint64, count=n),
            np.fromiter((r[1] for r in rows), dtype=np.uint8, count=n),
            np.fromiter((r[2] for r in rows), dtype=np.float64, count=n),
        )

    @classmethod
    def join(cls, parts: Sequence[Changes]) -> Changes:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.rows_of([])
        return cls(
            np.concatenate([p.digests for p in parts]),
            np.concatenate([p.seen for p in parts]),
            np.concatenate([p.when for p in parts]),
        )

    def __len__(self) -> int:
        return len(self.digests)

    def __getitem__(self, at: slice) -> Changes:
        return Changes(self.digests[at], self.seen[at], self.when[at])

    def __iter__(self) -> Iterator[tuple[int, int, float]]:
        return iter(self.rows())

    def rows(self) -> list[tuple[int, int, float]]:
        """``(digest, seen, when)`` per block, in order."""
        return list(zip(self.digests.tolist(), self.seen.tolist(), self.when.tolist(), strict=True))


class Ledger:
    """Block digest -> :class:`Seen`, at most ``capacity`` of them (insertion order: a
    block stored again moves to the end). The manager's ledger also keeps a change log
    that followers read with :meth:`since`; a follower applies them with :meth:`apply`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ledger capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._seen: dict[int, tuple[int, float]] = {}
        self._log: list[Changes] = []
        self._log_len = 0
        self._log_base = 0
        """Sequence number of the log's first entry."""

    def __len__(self) -> int:
        return len(self._seen)

    def state(self, digest: int) -> Seen:
        got = self._seen.get(digest)
        return Seen.NEVER if got is None else Seen(got[0])

    def record(self, changes: Changes) -> None:
        if not len(changes):
            return
        self._set(changes)
        self._log.append(changes)
        self._log_len += len(changes)
        if self._log_len > 2 * self.capacity:
            drop = self._log_len - self.capacity
            self._log_base += drop
            self._log_len -= drop
            while drop:
                first = self._log[0]
                if len(first) <= drop:
                    drop -= len(first)
                    del self._log[0]
                else:
                    self._log[0], drop = first[drop:], 0

    @property
    def seq(self) -> int:
        return self._log_base + self._log_len

    def since(self, seq: int) -> tuple[int, Changes, bool]:
        """``(new seq, changes, full)``: the changes after ``seq``, or (``full``) the
        whole record when the log no longer reaches back that far."""
        if seq < self._log_base or seq > self.seq:
            n = len(self._seen)
            states = list(self._seen.values())
            whole = Changes(
                np.fromiter(self._seen, dtype=np.uint64, count=n),
                np.fromiter((s for s, _ in states), dtype=np.uint8, count=n),
                np.fromiter((t for _, t in states), dtype=np.float64, count=n),
            )
            return self.seq, whole, True
        skip, parts = seq - self._log_base, []
        for chunk in self._log:
            if skip >= len(chunk):
                skip -= len(chunk)
                continue
            parts.append(chunk[skip:] if skip else chunk)
            skip = 0
        return self.seq, Changes.join(parts), False

    def apply(self, changes: Changes, full: bool) -> None:
        if full:
            self._seen.clear()
        self._set(changes)

    def _set(self, changes: Changes) -> None:
        seen = self._seen
        for d, s, t in changes.rows():
            old = seen.pop(d, None)
            seen[d] = (s, t) if old is None or t >= old[1] else old
        while len(seen) > self.capacity:
            del seen[next(iter(seen))]
