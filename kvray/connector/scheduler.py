"""Scheduler side of KVRayConnector: prefix lookups, load and save planning.

Nothing here blocks a scheduler step. A lookup is one Ray call to the Lookup actor;
``get_num_new_matched_tokens`` returns ``None`` ("ask again") until its ObjectRef is
ready, and treats a lookup older than ``lookup_timeout_ms`` (or a failed one) as a miss,
logged once and counted. A hit is pinned by the backend's read lease (Mooncake grants
one per ``exists``) until it is loaded; a block that vanished anyway fails its load,
which the worker reports to vLLM.

PD disaggregation through the pool: a prefill instance answers a request marked
``do_remote_decode`` (vLLM's convention; the proxy sets it) with ``kv_transfer_params``
``{"kvray": {"pool", "space", "blocks"}}``, the number of leading prompt blocks it stored
or found in the pool. The proxy forwards them with the decode request; the decode
instance's lookup then waits in the Lookup actor (up to ``pd_wait_ms``) until all of them
are there, since the prefill's last saves may still be in flight when its answer reaches
the proxy. To the scheduler that is just a slower lookup: other requests run meanwhile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from kvray.connector.common import InstanceInfo, attach_pool
from kvray.connector.fingerprint import (
    FIX,
    Fingerprint,
    mismatch_message,
    random_seed_message,
)
from kvray.connector.fingerprint import current as current_fingerprint
from kvray.connector.metadata import BlockOp, KVRayMetadata
from kvray.connector.stats import KVRayConnectorStats
from kvray.connector.timeline import RequestClock, StepTimes
from kvray.lookup import Answer
from kvray.misses import counter as miss_counter

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PARAMS_KEY = "kvray"
"""kvray's entry in vLLM's ``kv_transfer_params`` (next to other connectors' entries)."""


def _ended_in_error(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.FINISHED_ERROR


def hash_bytes(h: Any) -> bytes:
    """vLLM's block hashes are bytes (sha256); non-crypto algorithms give ints."""
    return h if isinstance(h, bytes) else int(h).to_bytes(16, "little", signed=True)


@dataclass
class _Lookup:
    ref: Any
    started: float
    first_block: int
    """The lookup counts leading hits from this block on."""
    timeout_s: float
    """When the answer is overdue (the lookup timeout, plus any PD wait)."""
    want: int = 0
    """Leading blocks (from ``first_block``) a prefill reported stored; 0: none."""


@dataclass
class _Request:
    """What the scheduler side tracks per request, from admission to finish."""

    request: Request
    local_blocks: int
    """Leading blocks vLLM's own prefix cache had."""
    pool_blocks: int = 0
    """Leading blocks after those that the pool had (and that get loaded)."""
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0
    """First block not yet stored (or known to be in the pool)."""
    computed_tokens: int = 0
    saves_issued: bool = False
    saved_blocks: int = 0
    load_failed_blocks: int = 0
    earlier: tuple[int, int, int] = (0, 0, 0)
    """(hit, loaded, failed) pool blocks of earlier admissions of this request (a failed
    load or a preemption sends it through lookup again)."""

    def totals(self) -> tuple[int, int, int]:
        hit, loaded, failed = self.earlier
        return (
            max(hit, self.pool_blocks),
            loaded + self.pool_blocks - self.load_failed_blocks,
            failed + self.load_failed_blocks,
        )


class KVRayScheduler:
    """One per engine instance, in the scheduler process."""

    def __init__(self, info: InstanceInfo) -> None:
        self.info = info
        self.block_size = info.block_size
        self._timeout_s = info.config.lookup_timeout_ms / 1e3
        handles = attach_pool(info.config, info.local_workers)
        self._manager = handles.manager
        self._lookup_actor = handles.lookup()  # this node's: the scheduler's
        # The first call from a new process sets up Ray's connection to the actor (often
        # longer than a lookup timeout): pay it now, not as a miss on the first request.
        ray.get(self._lookup_actor.lookup.remote(info.space, [], self._timeout_s), timeout=60)
        self._lookups: dict[str, _Lookup] = {}
        self._reqs: dict[str, _Request] = {}
        self._loads: list[BlockOp] = []
        self._async_loads: list[BlockOp] = []
        self._delayed: list[str] = []
        self._awaiting_frees: set[str] = set()
        self._block_owner: dict[int, str] = {}
        self._errored: dict[str, tuple[_Request, int, list[int]]] = {}
        """Requests that loaded from the pool and ended with an error this step: (state,
        block count, block ids), reported once the step's failed loads are known (under
        the ``fail`` policy vLLM ends such a request before it hands the connector the
        failed blocks)."""
        self._preempted: list[str] = []
        self._engine_busy = False
        self._clocks: dict[str, RequestClock] = {}
        """Per-request timelines, from first sight to finish."""
        self._step = 0
        self._first_token_steps: dict[int, list[str]] = {}
        """Step -> requests whose first token that step computes."""
        self._parked: dict[str, RequestClock] = {}
        """Finished requests whose first-token step's times are still to come (a request
        finishes, in vLLM's output handling, before that step's connector output)."""
        self.stats = KVRayConnectorStats()
        self._warned: set[str] = set()
        self._pd_wait_s = info.config.pd_wait_ms / 1e3
        space = info.space
        self._space_id = [space.namespace, space.layout, space.tp_size, space.pp_size]
        """What a prefill and a decode compare in ``kv_transfer_params`` (JSON-able)."""
        self._fingerprint: Fingerprint | None = None
        """How this engine hashes blocks: known from its first request on."""
        self._fingerprint_ref: Any = None
        logger.info(
            "KVRayConnector scheduler: pool %r at %s, keys %s@%s tp=%d pp=%d, load_async=%s",
            info.config.pool_name,
            handles.server_address,
            info.space.namespace,
            info.space.layout,
            info.space.tp_size,
            info.space.pp_size,
            info.config.load_async,
        )

    # ---- lookup --------------------------------------------------------------------------

    def _start_lookup(self, request: Request, first_block: int) -> _Lookup:
        hashes = [hash_bytes(h) for h in request.block_hashes[first_block:]]
        want = max(0, self._expected_from_prefill(request) - first_block)
        wait_s = self._pd_wait_s if want else 0.0
        if want:
            self.stats.add("pd_waits")
        ref = self._lookup_actor.lookup.remote(
            self.info.space, hashes, self._timeout_s, want, wait_s
        )
        clock = self._clock(request)
        if clock.timeline.lookup_sent_ms is None:
            clock.timeline.lookup_sent_ms = clock.now_ms()
        pending = _Lookup(ref, time.monotonic(), first_block, self._timeout_s + wait_s, want)
        self._lookups[request.request_id] = pending
        return pending

    def _clock(self, request: Request) -> RequestClock:
        clock = self._clocks.get(request.request_id)
        if clock is None:
            arrival = getattr(request, "arrival_time", None)
            clock = self._clocks[request.request_id] = RequestClock(arrival)
        return clock

    def _ensure_fingerprint(self) -> Fingerprint | None:
        """This engine's hash fingerprint, registered with the pool (which answers with the
        other ones it saw for the same model: checked in a later step, never waited for)."""
        if self._fingerprint is None:
            fp = current_fingerprint(self.info.hash_algo)
            if fp is None:
                return None
            self._fingerprint = fp
            if fp.seed_source == "random per process":
                self._warn_once("random-seed", "%s", random_seed_message(fp))
            space = self.info.space
            self._fingerprint_ref = self._manager.register_fingerprint.remote(
                f"{space.namespace}@{space.layout}", fp.as_dict()
            )
        return self._fingerprint

    def _check_fingerprint(self) -> None:
        ref = self._fingerprint_ref
        if ref is None or not ray.wait([ref], timeout=0)[0]:
            return
        self._fingerprint_ref = None
        try:
            others: list[dict[str, Any]] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            logger.warning("kvray: registering this engine's hash fingerprint failed: %s", exc)
            return
        if others and self._fingerprint is not None:
            self._warn_once(
                "fingerprint",
                "%s",
                mismatch_message(self.info.space.namespace, self._fingerprint, others),
            )

    def on_new_request(self, request: Request) -> None:
        """Start the lookup as the request arrives, so that it is usually answered by the
        time the scheduler first considers the request."""
        self._ensure_fingerprint()
        self._clock(request)
        if self.info.can_load and request.block_hashes:
            self._start_lookup(request, 0)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        local = num_computed_tokens // self.block_size
        hashes = request.block_hashes
        if not self.info.can_load or len(hashes) <= local:
            self._admit(_Request(request, local, next_save=local))
            clock = self._clock(request)
            clock.timeline.admitted_ms = clock.now_ms()
            return 0, False
        pending = self._lookups.get(rid)
        if pending is None or pending.first_block > local:
            self._start_lookup(request, local)
            return self._wait_a_step(request)
        # A busy engine is never stalled: ask again next step. An idle one (the last step
        # ran nothing) has nothing to delay, so wait for the answer instead of spinning
        # empty steps: each one also keeps vLLM's worker busy-polling for a second, which
        # starves the Lookup and BackendClient actors (and, on a small host, the prefill a
        # PD wait is waiting for). A request arriving meanwhile is scheduled once the
        # answer is in: at most the lookup timeout, or pd_wait_ms for a PD wait.
        remaining = max(0.0, pending.timeout_s - (time.monotonic() - pending.started))
        ready, _ = ray.wait([pending.ref], timeout=0 if self._engine_busy else remaining)
        if not ready:
            if time.monotonic() - pending.started < pending.timeout_s:
                return self._wait_a_step(request)
            self._clock(request).timeline.lookup_timed_out = True
            self._lookups.pop(rid)
            ray.cancel(pending.ref)
            self.stats.add("lookup_misses_timeout")
            self._warn_once(
                "timeout",
                "pool lookup slower than %.0f ms: counted as a miss",
                self._timeout_s * 1e3,
            )
            hit, why = 0, "lookup_timeout"
        else:
            self._lookups.pop(rid)
            try:
                answer: Answer = ray.get(pending.ref)
                leading, why = answer.hits, answer.miss
            except ray.exceptions.RayError as exc:
                self.stats.add("lookup_errors")
                self._warn_once("error", "pool lookup failed (%s): counted as a miss", exc)
                leading = pending.want = 0
                why = "lookup_error"
            if pending.first_block + leading < local and pending.first_block < local:
                # The early lookup (from block 0) stopped inside vLLM's local hit: what
                # follows the local hit is still unknown, so look up from there.
                self._start_lookup(request, local)
                return self._wait_a_step(request)
            if leading < pending.want:
                self._prefill_blocks_missing(rid, pending, leading)
            hit = max(0, pending.first_block + leading - local)
        clock = self._clock(request)
        clock.timeline.lookup_answered_ms = clock.now_ms()
        clock.timeline.admitted_ms = clock.timeline.lookup_answered_ms
        self.stats.add("lookup_us", int((time.monotonic() - pending.started) * 1e6))
        self.stats.add("lookups")
        self.stats.add("lookup_blocks", len(hashes) - local)
        self.stats.add("lookup_hit_blocks", hit)
        if len(hashes) - local > hit:
            self.stats.add(miss_counter(why or "not_stored"), len(hashes) - local - hit)
        # A full hit still leaves the last token to compute: vLLM needs one new token.
        hit_tokens = min((local + hit) * self.block_size, request.num_tokens - 1)
        external = max(0, hit_tokens - num_computed_tokens)
        pool_blocks = -(-external // self.block_size) if external else 0
        self._admit(
            _Request(request, local, pool_blocks=pool_blocks, next_save=local + pool_blocks)
        )
        if external == 0:
            return 0, False
        return external, self.info.config.load_async

    def _wait_a_step(self, request: Request) -> tuple[None, bool]:
        """The request sits out this step: its lookup is not answered yet."""
        self._clock(request).timeline.lookup_wait_steps += 1
        self.stats.add("lookup_wait_steps")
        return None, False

    def _expected_from_prefill(self, request: Request) -> int:
        """Leading blocks the request's prefill instance reported in the pool (0: none,
        or stored where this instance cannot read them, or not waiting for them)."""
        if self._pd_wait_s <= 0:
            return 0
        params = getattr(request, "kv_transfer_params", None)
        entry = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if entry is None:
            return 0
        if not isinstance(entry, dict) or not isinstance(entry.get("blocks"), int):
            self._warn_once("pd-params", "ignoring malformed kv_transfer_params.kvray %r", entry)
            return 0
        if entry.get("pool") != self.info.config.pool_name or entry.get("space") != self._space_id:
            self._warn_once(
                "pd-space",
                "the prefill instance stored under pool %r keys %r, this decode instance reads "
                "pool %r keys %r: nothing of its prefill can be loaded here (set pool_name and "
                "model_namespace the same on both, and prefill_pp_size for a PP prefill)",
                entry.get("pool"),
                entry.get("space"),
                self.info.config.pool_name,
                self._space_id,
            )
            return 0
        mine = self._ensure_fingerprint()
        theirs = entry.get("hash")
        if mine is not None and theirs is not None and theirs != mine.hash_domain:
            # The prefill's blocks are under hashes this instance never derives: waiting
            # for them would only add pd_wait_ms to every request.
            self.stats.add("pd_hash_mismatches")
            self._warn_once(
                "pd-hash",
                "the prefill instance hashes blocks in hash domain %s, this decode instance "
                "with %s: none of its blocks can be found here, so decode requests do not wait "
                "for them: %s",
                theirs,
                mine.describe(),
                FIX,
            )
            return 0
        return min(int(entry["blocks"]), len(request.block_hashes))

    def _prefill_blocks_missing(self, rid: str, pending: _Lookup, found: int) -> None:
        self.stats.add("pd_wait_timeouts")
        self._warn_once(
            "pd-timeout",
            "request %s: its prefill reported %d blocks stored, the pool had %d after %.0f ms "
            "(pd_wait_ms): loading those, recomputing the rest",
            rid,
            pending.first_block + pending.want,
            pending.first_block + found,
            self._pd_wait_s * 1e3,
        )

    def _admit(self, st: _Request) -> None:
        prev = self._reqs.get(st.request.request_id)
        # Only an admission that got blocks happened; one whose allocation failed is redone.
        if prev is not None and prev.block_ids:
            st.earlier = prev.totals()
            st.saves_issued = prev.saves_issued
            st.saved_blocks = prev.saved_blocks
        self._reqs[st.request.request_id] = st

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:  # admitted without a lookup (e.g. resumed): nothing to load
            st = self._reqs[request.request_id] = _Request(request, 0)
        st.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        first, last = st.local_blocks, st.local_blocks + st.pool_blocks
        op = BlockOp(
            request.request_id,
            tuple(hash_bytes(h) for h in request.block_hashes[first:last]),
            tuple(st.block_ids[first:last]),
        )
        (self._async_loads if self.info.config.load_async else self._loads).append(op)
        for block_id in op.block_ids:
            self._block_owner[block_id] = request.request_id

    # ---- per step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVRayMetadata:
        self._report_finished()  # those finished outside a step's output (aborts)
        self._check_fingerprint()
        scheduled = scheduler_output.num_scheduled_tokens
        self._engine_busy = bool(scheduled)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                st.computed_tokens = new.num_computed_tokens + scheduled.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                st.block_ids = list(new_ids[0])
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            st.computed_tokens = cached.num_computed_tokens[i] + scheduled.get(rid, 0)
        self._step += 1
        for step in [s for s in self._first_token_steps if s < self._step - 1000]:
            for rid in self._first_token_steps.pop(step):  # no step times ever came
                self._log_parked(rid)
        self._stamp_first_token_step(scheduled)
        saves = self._plan_saves(scheduled) if self.info.can_save else []
        for rid in scheduler_output.preempted_req_ids or ():
            st = self._reqs.pop(rid, None)
            for block_id in st.block_ids if st else ():
                if self._block_owner.get(block_id) == rid:
                    del self._block_owner[block_id]
            self._preempted.append(rid)
        meta = KVRayMetadata(
            self._loads, self._async_loads, saves, self._delayed, self._preempted, self._step
        )
        self._loads, self._async_loads, self._delayed, self._preempted = [], [], [], []
        return meta

    def _stamp_first_token_step(self, scheduled: dict[str, int]) -> None:
        """Note the step that completes each request's prompt (it samples the first
        token) and the prefill steps before it."""
        for rid in scheduled:
            st, clock = self._reqs.get(rid), self._clocks.get(rid)
            if st is None or clock is None or clock.first_step is not None:
                continue
            clock.timeline.prefill_steps += 1
            if st.computed_tokens >= st.request.num_prompt_tokens:
                clock.first_step = self._step
                clock.timeline.first_step_built_ms = clock.now_ms()
                self._first_token_steps.setdefault(self._step, []).append(rid)

    def _take_step_times(self, times: StepTimes) -> None:
        """A step's output is back: the first tokens it computed are out."""
        for step in [s for s in self._first_token_steps if s <= times.step]:
            for rid in self._first_token_steps.pop(step):
                clock = self._clocks.get(rid) or self._parked.get(rid)
                if clock is None:
                    continue
                tl = clock.timeline
                tl.first_token_ms = clock.now_ms()
                if step == times.step:
                    tl.load_wait_ms, tl.forward_ms = times.load_wait_ms, times.forward_ms
                self._log_parked(rid)

    def _log_parked(self, rid: str) -> None:
        clock = self._parked.pop(rid, None)
        if clock is not None:
            self._log_timeline(rid, clock)

    def _plan_saves(self, scheduled: dict[str, int]) -> list[BlockOp]:
        """Prompt blocks completed by this step and not yet in the pool."""
        saves = []
        for rid in scheduled:
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            full = min(st.computed_tokens, req.num_prompt_tokens) // self.block_size
            full = min(full, len(req.block_hashes), len(st.block_ids))
            if full <= st.next_save:
                continue
            saves.append(
                BlockOp(
                    rid,
                    tuple(hash_bytes(h) for h in req.block_hashes[st.next_save : full]),
                    tuple(st.block_ids[st.next_save : full]),
                )
            )
            st.saved_blocks += full - st.next_save
            st.next_save = full
            st.saves_issued = True
        return saves

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        times = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(times, StepTimes):
            self._take_step_times(times)
        for rid in output.finished_sending or ():
            self._awaiting_frees.discard(rid)
        for block_id in output.invalid_block_ids or ():
            owner = self._block_owner.get(block_id)
            st = self._reqs.get(owner) if owner else None
            if st is None and owner in self._errored:
                self._errored[owner][0].load_failed_blocks += 1
            elif st is not None:
                st.load_failed_blocks += 1
                # vLLM recomputes from the first failed block: store those blocks again.
                if block_id in st.block_ids:
                    st.next_save = min(st.next_save, st.block_ids.index(block_id))
        self._report_finished()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        st = self._reqs.pop(rid, None)
        clock = self._clocks.pop(rid, None)
        if clock is not None and st is not None:
            tl = clock.timeline
            tl.hit_pool, tl.loaded, _ = st.totals()
            if clock.first_step is not None and tl.first_token_ms is None:
                self._parked[rid] = clock  # logged once its first-token step's times came
            else:
                self._log_timeline(rid, clock)
        if st is None:
            self._release_blocks(rid, block_ids)
            return False, None
        if st.pool_blocks and _ended_in_error(request):
            # reported with this step's failed loads (update_connector_output)
            self._errored[rid] = (st, len(request.block_hashes), list(block_ids))
        else:
            self._release_blocks(rid, block_ids)
            self._log_request(rid, st, len(request.block_hashes))
        params = self._params_for_decode(request, st)
        if not st.saves_issued:
            return False, params
        # Keep the blocks until every worker reports its saves of them done.
        self._delayed.append(rid)
        self._awaiting_frees.add(rid)
        return True, params

    def _params_for_decode(self, request: Request, st: _Request) -> dict[str, Any] | None:
        """What a decode instance needs to find this prefill's blocks: only for requests
        marked ``do_remote_decode`` (the proxy's prefill requests)."""
        asked = getattr(request, "kv_transfer_params", None)
        if not self.info.can_save or not (
            isinstance(asked, dict) and asked.get("do_remote_decode")
        ):
            return None
        entry: dict[str, Any] = {
            "pool": self.info.config.pool_name,
            "space": self._space_id,
            "blocks": st.next_save,
        }
        fp = self._ensure_fingerprint()
        if fp is not None:
            entry["hash"] = fp.hash_domain
        return {PARAMS_KEY: entry}

    def _release_blocks(self, rid: str, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._block_owner.get(block_id) == rid:
                del self._block_owner[block_id]

    def _report_finished(self) -> None:
        for rid, (st, total, block_ids) in self._errored.items():
            self._release_blocks(rid, block_ids)
            self._log_request(rid, st, total)
        self._errored.clear()

    @staticmethod
    def _log_timeline(rid: str, clock: RequestClock) -> None:
        tl = clock.timeline
        if not logger.isEnabledFor(logging.DEBUG):
            return

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        logger.debug(
            "timeline request_id=%s arrival_lag=%s lookup_sent=%s lookup_answered=%s%s "
            "lookup_wait_steps=%d admitted=%s first_step_built=%s load_wait=%s forward=%s "
            "first_token=%s prefill_steps=%d (ms from first sight)",
            rid,
            ms(tl.arrival_lag_ms),
            ms(tl.lookup_sent_ms),
            ms(tl.lookup_answered_ms),
            " (timed out)" if tl.lookup_timed_out else "",
            tl.lookup_wait_steps,
            ms(tl.admitted_ms),
            ms(tl.first_step_built_ms),
            ms(tl.load_wait_ms),
            ms(tl.forward_ms),
            ms(tl.first_token_ms),
            tl.prefill_steps,
            extra={"kvray_timeline": {"request_id": rid, **tl.as_dict()}},
        )

    @staticmethod
    def _log_request(rid: str, st: _Request, total: int) -> None:
        hit, loaded, failed = st.totals()
        logger.info(
            "request_id=%s total_blocks=%d hit_local=%d hit_pool=%d loaded=%d failed=%d saved=%d",
            *(rid, total, st.local_blocks, hit, loaded, failed, st.saved_blocks),
        )

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_frees or self._delayed)

    def _warn_once(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (further ones are only counted)", msg % args)
