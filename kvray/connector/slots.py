"""Staged placement: the staging slots of transfers in flight.

A transfer reserves slots for its blocks; they are freed once every call that reads or
writes them has ended: a save's puts read them, and a load whose call failed or timed
out may still be written by it (its BackendClient keeps going). Staging is bounded, so
a transfer that finds it full waits for calls in flight to end, up to
``call_timeout_s``, and fails when none did (the pool is stuck), never the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvray.connector.calls import Waits
    from kvray.connector.staging import Stager
    from kvray.remote import Call

logger = logging.getLogger(__name__)


class StagingSlots:
    """Reserves staging slots, and holds them until the calls using them ended."""

    def __init__(
        self,
        stager: Stager,
        waits: Waits,
        timeout_s: float,
        rank: int,
        *,
        in_flight: Callable[[], list[Call[Any]]],
        progress: Callable[[], None],
    ) -> None:
        """``in_flight``: other calls whose end frees slots (async loads), besides the
        held ones; ``progress``: accounts for the calls that ended and frees their slots
        (:meth:`release_ended` included)."""
        self.stager = stager
        self._waits = waits
        self._timeout_s = timeout_s
        self._rank = rank
        self._in_flight = in_flight
        self._progress = progress
        self._holds: list[tuple[tuple[Call[Any], ...], int, int]] = []
        """(calls, first slot, slots): held until all these calls ended."""

    def hold(self, calls: Sequence[Call[Any]], first: int, n: int) -> None:
        """Slots ``first..first+n`` stay taken until every one of ``calls`` ended."""
        self._holds.append((tuple(calls), first, n))

    def held_calls(self) -> list[Call[Any]]:
        return [c for calls, _, _ in self._holds for c in calls]

    def release_ended(self) -> None:
        """Free the slots of every hold whose calls have all ended."""
        if not self._holds:
            return
        calls = self.held_calls()
        done = self._waits.ready(calls, 0, every=True) if calls else []
        ended = {id(c) for c, d in zip(calls, done, strict=True) if d}
        keep = []
        for hold in self._holds:
            if all(id(c) in ended for c in hold[0]):
                self.stager.release(hold[1], hold[2])
            else:
                keep.append(hold)
        self._holds = keep

    def reserve(self, n: int) -> int | None:
        """``n`` slots; waits for transfers in flight to release some when staging is
        full (bounded memory). None when nothing was released within ``call_timeout_s``
        (the pool is stuck): the caller fails that transfer."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            first = self.stager.reserve(n)
            if first is not None:
                return first
            calls = [*self.held_calls(), *self._in_flight()]
            assert calls, "staging full with nothing in flight"
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning(
                    "rank %d: no staging slot freed in %.0f s (pool calls in flight do not "
                    "finish); a transfer of %d blocks fails",
                    self._rank,
                    self._timeout_s,
                    n,
                )
                return None
            self._waits.ready(calls, left)
            self._progress()
