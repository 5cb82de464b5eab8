"""Scheduler side: this instance's own saves in flight, which its lookups wait for.

Users send the same prompt again as soon as its response is back, while the engine may
still be saving that prompt's blocks. A lookup that misses at a block this instance is
saving answers "ask again" (vLLM's ``None``) until that save has ended or failed, rather
than compute a block that is about to be a hit. The wait is bounded by the save's own
call timeout (``call_timeout_s``: a save that does not end by then has failed), not by
``lookup_timeout_ms``, which bounds only a pool that does not answer.

A save's end is known from the workers' step outputs (``StepTimes.saved_through``: every
rank's saves of that step and before ended). The node's index shows a store as soon as
the store returns, but a store whose report to the node's keeper failed reaches the index
through the pool's stream, a little later: a block whose save ended less than a lookup
timeout ago is still waited for.
"""

from __future__ import annotations

import time
from collections import deque

SAVING_KEPT = 1024
"""Steps whose saves in flight are remembered (the ranks' ends never came: forgotten)."""
SAVED_KEPT = 1 << 16
"""Blocks whose ended saves are remembered for a lookup timeout (about 100 bytes each)."""


class OwnSaves:
    """The blocks this instance is saving, and the requests whose lookups wait for them."""

    def __init__(self, save_timeout_s: float, index_lag_s: float) -> None:
        """``save_timeout_s``: how long a save may take before it counts as failed (the
        pool's ``call_timeout_s``); ``index_lag_s``: how long after a save ended its
        blocks may still be missing from the node's index (the lookup timeout)."""
        self.save_timeout_s = save_timeout_s
        self.index_lag_s = index_lag_s
        self._saving: dict[bytes, int] = {}
        """Block hash -> the step that asked for its save, until every rank's saves of that
        step ended."""
        self._steps: deque[tuple[int, tuple[bytes, ...]]] = deque()
        """The same, by step (oldest first), to forget them in the order they end."""
        self._saved_at: dict[bytes, float] = {}
        """Block hash -> when its save ended (oldest first)."""
        self._waits: dict[str, tuple[float, int]] = {}
        """Request -> since when its lookup waits, and ``_ended`` when its latest lookup
        started."""
        self._expired: set[str] = set()
        """Requests whose wait ran out (their request line says ``miss=save_in_flight``)."""
        self._ended = 0
        """How many step outputs ended saves (a lookup older than one may have missed them)."""

    def lookup_started(self, rid: str) -> None:
        """A lookup of ``rid`` starts: its answer includes the saves ended so far."""
        waiting = self._waits.get(rid)
        if waiting is not None:
            self._waits[rid] = (waiting[0], self._ended)

    def awaits(self, rid: str, digest: bytes | None) -> bool:
        """``rid``'s lookup missed at the block ``digest``: True when it should ask again
        (that block's save by this instance is in flight, ended too recently for the index,
        or ended after the lookup started); False when the miss stands."""
        now = time.monotonic()
        waiting = self._waits.get(rid)
        in_flight = digest is not None and digest in self._saving
        ended = self._saved_at.get(digest) if digest is not None else None
        recent = ended is not None and now - ended < self.index_lag_s
        if not in_flight and not recent and (waiting is None or waiting[1] == self._ended):
            self._waits.pop(rid, None)
            return False
        since = waiting[0] if waiting is not None else now
        # In flight: up to the save's timeout from the wait's start; ended: up to the
        # index's lag from the save's end (a long wait for a slow save leaves the index
        # its whole lag once the save ended).
        start = since if in_flight or ended is None else max(since, ended)
        if now - start > (self.save_timeout_s if in_flight else self.index_lag_s):
            self._waits.pop(rid, None)
            self._expired.add(rid)
            return False
        self._waits[rid] = (since, self._ended)
        return True

    def expired(self, rid: str) -> bool:
        """Whether ``rid``'s wait ran out (said once)."""
        if rid in self._expired:
            self._expired.discard(rid)
            return True
        return False

    def forget(self, rid: str) -> None:
        self._waits.pop(rid, None)
        self._expired.discard(rid)

    def saving(self, step: int, hashes: tuple[bytes, ...]) -> None:
        """``step`` saves these blocks."""
        if hashes:
            self._saving.update(dict.fromkeys(hashes, step))
            self._steps.append((step, hashes))
        if len(self._steps) > SAVING_KEPT:  # the ranks' ends never came
            self.ended_through(self._steps[0][0])

    def ended_through(self, step: int) -> None:
        """Every rank's saves of ``step`` and before ended (stored or failed)."""
        if not self._steps or self._steps[0][0] > step:
            return
        now, saved_at = time.monotonic(), self._saved_at
        while saved_at:  # oldest first: forget those the index has had time to show
            first = next(iter(saved_at))
            if now - saved_at[first] < self.index_lag_s and len(saved_at) < SAVED_KEPT:
                break
            del saved_at[first]
        while self._steps and self._steps[0][0] <= step:
            at, hashes = self._steps.popleft()
            for h in hashes:
                if self._saving.get(h) == at:  # not saved again since
                    del self._saving[h]
                    saved_at.pop(h, None)
                    saved_at[h] = now
        self._ended += 1
