"""The priority of a native client's own copy thread: a store's copy yields the cores to
an engine's forward, a load's copy does not.

Mooncake's client copies the bytes of a store into its own segment, and a load's out of
it, on one native thread of its own (its transfer submitter's memcpy worker), not on the
thread that made the batch call: measured, a 64 MiB ``batch_put_from`` took 0.4 ms of the
calling thread and 46 ms of that one. So the niceness of kvray's store threads
(``save_niceness``) never reached the copy. Measured on a 2-core host, a torch forward of
about 220 ms on both cores beside a client storing 64 MiB every 20 ms: 300 ms with the
copy thread at niceness 0, 222-244 ms at 19, where the stores still moved 1.4 GB/s (1.9 at
0) in the forward's gaps.

:class:`CopyThread` finds that thread (the one thread the client's setup started whose
CPU time a store's copy raised: the schedulers' nanosecond run times before and after a
store) and holds it at the save niceness whenever no load is in flight, at its own while
one is: a load the engine waits for is never slowed, and the stores queued ahead of it on
the same thread run at the load's priority until it is done.

Raising a thread's niceness needs no privilege, lowering it again does (``CAP_SYS_NICE``,
or ``RLIMIT_NICE`` of 20 and more). Where this process may not lower a niceness, the
copy thread keeps its own and only kvray's store threads run nicer (logged once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

MIN_BYTES = 32 << 20
"""Bytes stored over one window that decides which thread copies (less is too little to
tell): a window opens with a store and closes with the store that brings it this many."""
WINDOW_S = 2.0
"""A window older than this that has not stored enough is dropped, not counted as a try:
other threads' own work over a long window would hide the copies."""
MIN_CPU_NS = 500_000
"""The copy thread took at least this much CPU over a deciding window (32 MiB copy in
1.6 ms at 20 GB/s, in 6 ms at this host's 5)."""
LEAD = 4
"""... and at least this many times the CPU of any other thread the setup started."""
TRIES = 16
"""Deciding stores tried before giving up (logged)."""


def threads() -> set[int]:
    """This process's thread ids."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def run_ns(tids: Iterable[int]) -> dict[int, int]:
    """Nanoseconds each of ``tids`` has run (the scheduler's count); the ended ones left out."""
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            pass
    return out


def can_lower_niceness() -> bool:
    """Whether a thread of this process may lower its niceness again once raised."""
    ok: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.getpriority(os.PRIO_PROCESS, tid)
            if base >= 19:
                ok.append(False)
                return
            os.setpriority(os.PRIO_PROCESS, tid, base + 1)
            os.setpriority(os.PRIO_PROCESS, tid, base)
            ok.append(True)
        except OSError:
            ok.append(False)

    t = threading.Thread(target=probe, name="kvray-nice-probe")
    t.start()
    t.join()
    return bool(ok and ok[0])


class CopyThread:
    """The client's copy thread among ``candidates`` (the threads its setup started), held
    at ``niceness`` while no load is in flight. All methods run on the event loop's thread.

    Around each store until the thread is found: ``before_store()`` and
    ``after_store(nbytes)``. Around each load: ``load_started()`` and ``load_ended()``."""

    def __init__(self, what: str, candidates: set[int], niceness: int) -> None:
        self._what = what
        self._candidates = frozenset(candidates)
        self._niceness = niceness
        self._tid: int | None = None
        self._own = 0
        """The copy thread's niceness when found (a load's)."""
        self._loads = 0
        self._tries = 0
        self._mark: dict[int, int] | None = None
        """The candidates' run times when the open window opened."""
        self._opened = 0.0
        self._stored = 0
        self._searching = niceness > 0 and bool(candidates)
        if self._searching and not can_lower_niceness():
            self._searching = False
            logger.info(
                "%s: this process may not lower a thread's niceness again (no CAP_SYS_NICE), "
                "so its copy thread keeps its own and save_niceness %d applies to kvray's "
                "store threads only",
                what,
                niceness,
            )

    @property
    def searching(self) -> bool:
        """Whether stores are still timed to find the copy thread."""
        return self._searching

    @property
    def candidates(self) -> frozenset[int]:
        """The threads the client's setup started."""
        return self._candidates

    @property
    def tid(self) -> int | None:
        """The copy thread's id once found."""
        return self._tid

    def before_store(self) -> None:
        """Open a window, while the copy thread is still to be found and none is open."""
        if self._searching and self._mark is None:
            self._mark = run_ns(self._candidates)
            self._opened = time.monotonic()
            self._stored = 0

    def after_store(self, nbytes: int) -> None:
        """Count a store's bytes in the open window; once it holds :data:`MIN_BYTES`, find
        the copy thread from what the window ran."""
        mark = self._mark
        if mark is None or not self._searching:
            return
        self._stored += nbytes
        if self._stored < MIN_BYTES:
            if time.monotonic() - self._opened > WINDOW_S:
                self._mark = None
            return
        self._mark = None
        now = run_ns(mark)
        deltas = sorted(((now[t] - mark[t], t) for t in now), reverse=True)
        self._tries += 1
        if deltas and deltas[0][0] >= MIN_CPU_NS:
            runner_up = deltas[1][0] if len(deltas) > 1 else 0
            if deltas[0][0] >= LEAD * runner_up:
                self._found(deltas[0][1])
                return
        if self._tries >= TRIES:
            self._searching = False
            logger.info(
                "%s: no single thread did its stores' copies over %d windows; save_niceness "
                "applies to kvray's store threads only",
                self._what,
                TRIES,
            )

    def _found(self, tid: int) -> None:
        self._searching = False
        try:
            self._own = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:
            return
        self._tid = tid
        logger.info(
            "%s: its copy thread %d runs at niceness %d while no load is in flight",
            self._what,
            tid,
            max(self._own, self._niceness),
        )
        if self._loads == 0:
            self._set(max(self._own, self._niceness))

    def load_started(self) -> None:
        self._loads += 1
        if self._loads == 1 and self._tid is not None:
            self._set(self._own)

    def load_ended(self) -> None:
        self._loads -= 1
        if self._loads == 0 and self._tid is not None:
            self._set(max(self._own, self._niceness))

    def _set(self, niceness: int) -> None:
        assert self._tid is not None
        try:
            os.setpriority(os.PRIO_PROCESS, self._tid, niceness)
        except OSError as e:  # (the thread ended, or the process lost the privilege)
            logger.info("%s: copy thread %d left as it is: %s", self._what, self._tid, e)
            self._tid = None
