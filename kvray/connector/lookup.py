"""Scheduler side: the pool lookups in flight, one per request, polled without blocking a
step.

With the pool's ``lookup_index``, a lookup reads the node's block index
(kvray/index/block_index.py), mapped into this process, and is answered on the spot, with no
call: a hit there that is gone by load time is a failed load (recomputed, counted
``gone_at_load``). The blocks loaded in a step are pinned with one call to the Lookup
actor for the step (Mooncake leases them until the load), sent and not waited for. Only a
PD decode's wait for its prefill's blocks still asks the actor, and every lookup does
while the index is not current (its keeper last current more than ``INDEX_STALE_S`` ago).

A lookup is one call to this node's Lookup actor: how many leading blocks (from a
request's first block not in vLLM's own prefix cache) the pool holds for every rank of
the instance. The scheduler polls it each step; one not answered within
``lookup_timeout_ms`` (plus any PD wait) is cancelled and counted as a miss
(``lookup_timeout``), one that failed too (``lookup_error``): a slow or broken pool costs
hits, never a stalled engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvray.errors import KVRayError
from kvray.index.block_index import DRAM, GONE, REMOVED, TIERS, BlockIndex
from kvray.index.lookup import Answer, Place, ssd_places
from kvray.index.stream import INDEX_STALE_S
from kvray.misses import counter as miss_counter

if TYPE_CHECKING:
    from kvray.connector.calls import Waits
    from kvray.connector.stats import KVRayConnectorStats
    from kvray.index.lookup import Placement
    from kvray.keys import KeySpace
    from kvray.remote import Call, LookupHandle

REPORT_S = 1.0
"""How often a scheduler sends the counters of the lookups its index answered to the
node's Lookup actor (so ``kvray status`` and the pool's metrics count them)."""
FINISHED_REPORT_S = 0.1
"""A finished request's counters are sent this long after it finished, from a thread of
their own, with those of every request that finished meanwhile: never a Ray call on the
request's path, at most one call per this interval."""


Warn = Callable[..., None]
"""``warn(kind, msg, *args)``: log once per kind, count the rest."""


@dataclass
class PendingLookup:
    call: Call[Answer] | None
    """None: answered from the node's block index (``answer``)."""
    started: float
    first_block: int
    """The lookup counts leading hits from this block on."""
    timeout_s: float
    """When the answer is overdue (the lookup timeout, plus any PD wait)."""
    want: int = 0
    """Leading blocks (from ``first_block``) a prefill reported stored; 0: none."""
    timed_out: bool = False
    """Answered by the scheduler itself: the lookup was overdue (and was cancelled)."""
    answer: Answer | None = None
    """The answer already known (from the node's block index)."""


def _why(vals: np.ndarray, held: np.ndarray) -> str:
    """Why a block missed, from its columns' entries in the index (see kvray.misses)."""
    if held.any():
        return "partial_ranks"
    if (vals & np.uint32(REMOVED)).any():
        return "removed"
    if (vals & np.uint32(GONE | TIERS)).any():
        return "evicted"  # gone at a load, or only in another worker's SSD tier
    return "not_stored"


class Lookups:
    """The instance's lookups in flight, by request id."""

    def __init__(
        self,
        handle: LookupHandle,
        waits: Waits,
        space: KeySpace,
        timeout_s: float,
        stats: KVRayConnectorStats,
        warn: Warn,
        node_id: str = "",
    ) -> None:
        """``node_id``: this process's node (whose slots hold an instance's SSD blocks
        when its workers did not say where they load through)."""
        self._handle = handle
        self._node_id = node_id
        self._index: BlockIndex | None = None
        self._waits = waits
        self._space = space
        self.timeout_s = timeout_s
        self._stats = stats
        self._warn = warn
        self._pending: dict[str, PendingLookup] = {}
        self._may_hit: set[str] = set()
        """Requests whose pending lookup the node's index answered with a hit, or a call
        still answers: the hits a step may still admit (``load_async: auto`` counts
        them)."""
        self._counts: dict[str, int] = {}
        """Lookup counters of the index's answers not yet reported to the Lookup actor."""
        self._counts_lock = threading.Lock()
        """Taken by the scheduler's thread to count, and by whichever thread sends."""
        self._reported_at = 0.0
        self._checked_at = 0.0
        self._finished = threading.Event()
        """A request finished with counters not yet sent: the reporter thread sends them."""
        self._reporter: threading.Thread | None = None
        self._closed = False

    @property
    def space(self) -> KeySpace:
        return self._space

    @space.setter
    def space(self, space: KeySpace) -> None:
        """The instance's keys once its workers' block geometries are known."""
        self._space = space

    def warm_up(self) -> None:
        """The first call from a new process sets up Ray's connection to the actor (often
        longer than a lookup timeout): paid here, not as a miss on the first request."""
        self._handle.lookup(self._space, [], self.timeout_s).result(60)
        spec = self._handle.index_spec().result(60)
        if spec is not None:
            try:
                self._index = BlockIndex.attach(spec)
            except KVRayError as exc:  # another node's (a test harness), or gone already
                self._warn("index", "the node's block index is not mappable (%s): lookups "
                           "ask the Lookup actor", exc)  # fmt: skip

    def _from_index(self, hashes: Sequence[bytes], placement: Placement | None) -> Answer | None:
        """The answer of the node's block index, or None: no current index, ask the
        Lookup actor. A block counts where every column of it is held in the pool's DRAM
        or in the SSD tier of the node slot whose worker loads that column."""
        index = self._index
        if index is None or not hashes:
            return None
        if self._index_gone(index):
            return None
        if index.age_s() > INDEX_STALE_S:
            self._stats.add("index_stale")
            return None
        space, n = self._space, len(hashes)
        masks = np.empty(space.columns, dtype=np.uint32)
        places = ssd_places(space.world_size, placement, self._node_id)
        for c in range(space.columns):
            place: Place | None = places[space.column(c)[0]]
            ssd = index.place_bit(place.node_id, place.slot) if place is not None else 0
            masks[c] = DRAM | ssd
        hits, vals, held = index.lookup(space, hashes, masks)
        self._stats.add("index_hits" if hits else "index_misses")
        ssd = int((vals[:, :hits] & DRAM == 0).any(axis=0).sum())
        why = "" if hits == n else _why(vals[:, hits], held[:, hits])
        answer = Answer(hits, why, ssd)
        self._count(answer, n, ssd)
        return answer

    def _count(self, answer: Answer, n: int, ssd_only: int) -> None:
        """The pool's lookup counters (``kvray status``, metrics) for a lookup the index
        answered: sent to the Lookup actor by the next :meth:`report` that sends."""
        with self._counts_lock:
            c = self._counts
            c["lookups"] = c.get("lookups", 0) + 1
            c["lookup_blocks"] = c.get("lookup_blocks", 0) + n
            c["lookup_hit_blocks"] = c.get("lookup_hit_blocks", 0) + answer.hits
            c["lookup_ssd_blocks"] = c.get("lookup_ssd_blocks", 0) + ssd_only
            if answer.miss:
                name = miss_counter(answer.miss)
                c[name] = c.get(name, 0) + n - answer.hits

    def count(self, name: str, n: int) -> None:
        """Add ``n`` to the pool's counter ``name`` (a :class:`~kvray.stats.RankStats`
        field), reported with the index's counters."""
        with self._counts_lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def _index_gone(self, index: BlockIndex) -> bool:
        """Whether ``index``'s keeper is gone (restarted, or its pool stopped); if so it is
        unmapped here and lookups ask the Lookup actor."""
        if not index.stale():
            return False
        index.close()
        self._index = None
        self._warn("index-gone", "the node's block index went away: lookups ask the "
                   "Lookup actor until the scheduler maps the new one")  # fmt: skip
        return True

    def report(self, *, finished: bool = False) -> None:
        """Send the index's lookup counters to the Lookup actor (one call, not waited
        for): once per scheduler step at most every :data:`REPORT_S`; ``finished`` (a
        request finished, and with it maybe the engine's last step for a while): the
        reporter thread sends them :data:`FINISHED_REPORT_S` later, so the pool's
        counters include the request soon after it, without a call on its path. A step
        also unmaps an index whose keeper is gone (a pool stopped under a running
        engine)."""
        at = time.monotonic()
        if not finished and at - self._checked_at >= REPORT_S:  # a stat: once a second
            self._checked_at = at
            if self._index is not None:
                self._index_gone(self._index)
        if not self._counts:
            return
        if finished:
            if self._reporter is None:
                self._reporter = threading.Thread(
                    target=self._report_finished, name="kvray-lookup-reports", daemon=True
                )
                self._reporter.start()
            self._finished.set()
        elif at - self._reported_at >= REPORT_S:
            self._send()

    def _send(self) -> None:
        with self._counts_lock:
            counts, self._counts = self._counts, {}
            self._reported_at = time.monotonic()
        if counts:
            self._handle.report(counts)

    def _report_finished(self) -> None:
        while True:
            self._finished.wait()
            if self._closed:
                return
            time.sleep(FINISHED_REPORT_S)  # (those finishing meanwhile go in the same call)
            self._finished.clear()
            if self._closed:
                return
            self._send_or_warn()

    def _send_or_warn(self) -> None:
        """:meth:`_send` off the scheduler's path, where a failure has no caller."""
        try:
            self._send()
        except Exception as exc:  # (Ray going down with the engine)
            self._warn("report", "lookup counters not sent to the pool: %s", exc)

    def close(self) -> None:
        """Send what is left and stop the reporter thread (the engine shuts down)."""
        self._closed = True
        self._finished.set()
        if self._reporter is not None:
            self._reporter.join(timeout=REPORT_S + 1)
        self._send_or_warn()

    def start(
        self,
        req_id: str,
        hashes: Sequence[bytes],
        first_block: int,
        want: int,
        wait_s: float,
        placement: Placement | None = None,
    ) -> PendingLookup:
        """Look up ``hashes`` (the request's, from ``first_block`` on); with ``want``, wait
        up to ``wait_s`` in the Lookup actor for that many leading blocks (PD);
        ``placement``: where each rank's worker loads through (the SSD tiers to ask)."""
        if want:
            self._stats.add("pd_waits")
        else:
            answer = self._from_index(hashes, placement)
            if answer is not None:
                done = PendingLookup(None, time.monotonic(), first_block, 0.0, answer=answer)
                self._pending[req_id] = done
                if answer.hits:
                    self._may_hit.add(req_id)
                else:
                    self._may_hit.discard(req_id)
                return done
        call = self._handle.lookup(self._space, hashes, self.timeout_s, want, wait_s, placement)
        pending = PendingLookup(call, time.monotonic(), first_block, self.timeout_s + wait_s, want)
        self._pending[req_id] = pending
        self._may_hit.add(req_id)
        return pending

    def hits_to_come(self, besides: str) -> int:
        """Requests other than ``besides`` not yet taken by the scheduler whose lookups
        the node's index answered with a hit, or that a call still answers (counted as
        hits: without the index, each request's answer comes only when it is taken)."""
        return len(self._may_hit) - (besides in self._may_hit)

    def _forget(self, req_id: str) -> None:
        del self._pending[req_id]
        self._may_hit.discard(req_id)

    def get(self, req_id: str) -> PendingLookup | None:
        return self._pending.get(req_id)

    def pin(self, hashes: Sequence[bytes]) -> None:
        """Pin the blocks a step loads (answered from the index) until their load: one
        call for the step, not waited for (a failed pin only leaves the block unpinned)."""
        if self._index is not None and hashes:
            self._handle.pin(self._space, list(hashes), self.timeout_s)
            self._stats.add("index_pins")

    def drop(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._may_hit.discard(req_id)

    def drop_all(self) -> None:
        """Forget every lookup in flight (their requests look up again)."""
        for pending in self._pending.values():
            if pending.call is not None:
                pending.call.cancel()
        self._pending.clear()
        self._may_hit.clear()

    def poll(self, req_id: str, pending: PendingLookup, *, wait: bool) -> Answer | None:
        """The answer of ``pending``, or None: not yet, ask again next step. ``wait``: the
        engine is idle, so wait for it (up to its timeout) instead of spinning empty
        steps. Overdue: cancelled, answered as a ``lookup_timeout`` miss (and
        ``pending.timed_out``); failed: a ``lookup_error`` miss."""
        if pending.answer is not None:
            self._forget(req_id)
            return pending.answer
        assert pending.call is not None, "a lookup with neither a call nor an answer"
        remaining = max(0.0, pending.timeout_s - (time.monotonic() - pending.started))
        (done,) = self._waits.ready([pending.call], remaining if wait else 0)
        if not done:
            if time.monotonic() - pending.started < pending.timeout_s:
                return None
            pending.timed_out = True
            self._forget(req_id)
            pending.call.cancel()
            self._stats.add("lookup_misses_timeout")
            self._warn(
                "timeout",
                "pool lookup slower than %.0f ms: counted as a miss",
                self.timeout_s * 1e3,
            )
            return Answer(0, "lookup_timeout")
        self._forget(req_id)
        try:
            answer: Answer = pending.call.result(None)
        except KVRayError as exc:
            self._stats.add("lookup_errors")
            self._warn("error", "pool lookup failed (%s): counted as a miss", exc)
            pending.want = 0
            return Answer(0, "lookup_error")
        return answer
