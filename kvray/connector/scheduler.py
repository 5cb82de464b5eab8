"""Scheduler side of KVRayConnector: the front vLLM's scheduler hooks call. It admits
requests with what the pool holds for them (:mod:`kvray.connector.lookup`), plans each
step's loads and saves as :class:`~kvray.connector.metadata.KVRayMetadata`
(:mod:`kvray.connector.request_state`), and follows requests to their finish.

Nothing here blocks a scheduler step. ``get_num_new_matched_tokens`` returns ``None``
("ask again") until the request's lookup is answered, and treats a lookup older than
``lookup_timeout_ms`` (or a failed one) as a miss, logged once and counted. A hit is
pinned by the backend's read lease (Mooncake grants one per ``exists``) until it is
loaded; a block that vanished anyway fails its load, which the worker reports to vLLM.

A step's saves never include a block computed over a sync load whose outcome is not back
yet: if that load failed, the forward attended to whatever the block held, so every block
computed after it in that step is wrong, although vLLM recomputes them. The request's saves
wait until the step's output says its loads were good (``plan_saves``'s ``unverified``).

PD disaggregation through the pool (:mod:`kvray.connector.pd_params`): a decode's lookup
may wait in the Lookup actor for the blocks its prefill reported stored; this engine's
hash fingerprint is registered with the pool (:mod:`kvray.connector.hash_registration`).

Per-request timelines are logged at DEBUG on this module's logger (tests and
``scripts/_engines.py`` collect them there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvray.connector import handshake
from kvray.connector.attach import attach_pool
from kvray.connector.calls import RayWaits, Waits
from kvray.connector.events import BlockDescriber, topic_of
from kvray.connector.hash_registration import HashRegistration
from kvray.connector.instance import InstanceInfo
from kvray.connector.load_policy import FAIL, FAIL_WARNING
from kvray.connector.log_lines import KEYS_FORMAT, RequestLine, groups_note, log_request
from kvray.connector.lookup import Lookups, PendingLookup
from kvray.connector.metadata import BlockOp, KVRayMetadata
from kvray.connector.own_saves import OwnSaves
from kvray.connector.pd_params import PDParams
from kvray.connector.pins import BlockPins
from kvray.connector.request_state import (
    RequestState,
    ended_in_error,
    finished_normally,
    group_op,
    hash_bytes,
    offered_states,
    plan_saves,
    step_pairs,
    track_scheduled,
)
from kvray.connector.stats import KVRayConnectorStats
from kvray.connector.timeline import RequestClock, StepTimes
from kvray.connector.timelines import RequestTimelines
from kvray.connector.worth import Decision, StepSoFar, Worth
from kvray.errors import KVRayError
from kvray.misses import counter as miss_counter
from kvray.warn_once import WarnOnce

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvray.index.lookup import Place, Placement
    from kvray.launcher import PoolHandles

logger = logging.getLogger(__name__)


class KVRayScheduler:
    """One per engine instance, in the scheduler process."""

    def __init__(
        self, info: InstanceInfo, pool: PoolHandles | None = None, waits: Waits | None = None
    ) -> None:
        """``pool`` and ``waits``: the pool's handles (attached from ``info`` when None)
        and how calls are waited for (Ray's when None); tests pass fakes."""
        self.info = info
        self.block_size = info.block_size
        pool = pool if pool is not None else attach_pool(info.config, info.local_workers)
        self.stats = KVRayConnectorStats()
        self._warn_once = WarnOnce(logger, " (further ones are only counted)")
        self._lookups = Lookups(
            pool.lookup(),  # this node's: the scheduler's
            waits if waits is not None else RayWaits(),
            info.space,
            info.config.lookup_timeout_ms / 1e3,
            self.stats,
            self._warn_once,
            pool.node_id,
        )
        self._lookups.warm_up()
        self._placement: Placement | None = None
        """Instance rank -> where its worker loads through (from the workers' handshake;
        None: unknown, lookups ask this node's slot per rank)."""
        self._manager = pool.manager
        self._call_timeout_s = pool.config.call_timeout_s
        self._hashes = HashRegistration(pool.manager, info, self._warn_once)
        self._describer: BlockDescriber | None = None
        """The saved blocks' descriptions for the pool's KV events (``kv_events``)."""
        if pool.config.kv_events is not None:
            topic = topic_of(pool.config.kv_events, info, pool.config.name, pool.node_ip())
            self._describer = BlockDescriber(pool.manager, info, topic, self._warn_once)
        self._pd = PDParams(info, self._hashes, self.stats, self._warn_once)
        self._reqs: dict[str, RequestState] = {}
        self._loads: list[BlockOp] = []
        self._async_loads: list[BlockOp] = []
        self._delayed: list[str] = []
        self._awaiting_frees: set[str] = set()
        self._block_owner: dict[int, str] = {}
        self._unverified: dict[int, int] = {}
        """Block id -> the step whose sync load wrote it, until that step's output is back
        (its failed loads are known then): saves over these blocks wait (plan_saves)."""
        self._late_saves: list[BlockOp] = []
        """Saves of finished requests that were held until their loads were known good."""
        self._own_saves = OwnSaves(pool.config.call_timeout_s, self._lookups.timeout_s)
        """This instance's saves in flight, which its lookups wait for."""
        self._pins = BlockPins()
        """Sliding-window and state blocks held until their saves ended (a hybrid
        model's)."""
        self.load_failure_policy = ""
        """What vLLM does with failed loads (from the workers' handshake)."""
        self._errored: dict[str, tuple[RequestState, int, list[int]]] = {}
        """Requests that loaded from the pool and ended with an error this step: (state,
        block count, block ids), reported once the step's failed loads are known (under
        the ``fail`` policy vLLM ends such a request before it hands the connector the
        failed blocks)."""
        self._preempted: list[str] = []
        self._engine_busy = False
        self._so_far = StepSoFar()
        """What the step being scheduled holds so far (``load_async: auto`` weighs a
        further hit against it)."""
        self._save_waiters = False
        """A lookup of this step waits for this instance's own saves in flight."""
        self._timelines = RequestTimelines(logger)
        self._worth = Worth()
        """This engine's measured load and compute rates: whether a hit is worth loading."""
        self._step = 0
        logger.info(
            "KVRayConnector scheduler: pool %r at %s, keys %s@%s tp=%d pp=%d, load_async=%s",
            info.config.pool_name,
            pool.server_address,
            info.space.namespace,
            info.space.layout,
            info.space.tp_size,
            info.space.pp_size,
            info.config.load_async,
        )

    # ---- keys ----------------------------------------------------------------------------

    def use_handshake(self, metadata: Iterable[object]) -> None:
        """The workers' handshake (:mod:`kvray.connector.handshake`): their block
        geometries, part of every key, so lookups ask for the keys the workers store;
        where each rank loads through; the load-failure policy vLLM applies."""
        got = handshake.merged(metadata)
        self._use_places(got.places)
        self._use_policy(got.policy)
        space = self.info.space
        self.info = replace(self.info, space=handshake.with_geometries(space, got.geometries))
        self._lookups.space = self.info.space
        logger.info(
            KEYS_FORMAT,
            space.namespace,
            space.layout,
            ",".join(self.info.space.geometries),
            groups_note(space),
        )

    def _use_policy(self, policy: str) -> None:
        """Warned about once when it ends requests, and registered with the pool beside the
        hash fingerprint."""
        self.load_failure_policy = policy
        self._hashes.load_failure_policy = policy
        if policy == FAIL:
            self._warn_once("load-failure-policy", "%s", FAIL_WARNING)
        else:
            logger.info(
                "KVRayConnector: a failed load is recomputed (kv_load_failure_policy %r)", policy
            )

    def _use_places(self, places: dict[int, Place]) -> None:
        """The SSD tier each lookup asks for a rank's keys; incomplete, said once."""

        def warn(missing: list[int]) -> None:
            self._warn_once(
                "placement",
                "KVRayConnector: the workers of ranks %s did not say where they run: SSD "
                "lookups ask this node's slot per rank (as for a one-node instance)",
                missing,
            )

        self._placement = handshake.placement(places, self.info.space.world_size, warn)
        if self._placement is not None:
            logger.info(
                "KVRayConnector scheduler: SSD lookups ask, per rank, %s",
                ", ".join(
                    f"rank {r}: slot {p.slot} of node {p.node_id}"
                    for r, p in self._placement.items()
                ),
            )

    def _keys_known(self) -> bool:
        """Lookups need every rank's geometry; without it a lookup would ask for keys no
        worker stores: a miss, said once, never a wrong key."""
        if self.info.space.complete:
            return True
        self._warn_once(
            "no-geometry",
            "KVRayConnector: the workers' block geometries never reached the scheduler "
            "(vLLM did not call set_xfer_handshake_metadata): every lookup is a miss",
        )
        return False

    # ---- lookup --------------------------------------------------------------------------

    def _start_lookup(self, request: Request, first_block: int) -> PendingLookup:
        want = max(0, self._pd.expected_blocks(request) - first_block)
        last = self._lookup_blocks(request)
        hashes = [hash_bytes(h) for h in request.block_hashes[first_block:last]]
        wait_s = self._pd.wait_s if want else 0.0
        pending = self._lookups.start(
            request.request_id, hashes, first_block, want, wait_s, self._placement
        )
        clock = self._clock(request)
        if clock.timeline.lookup_sent_ms is None:
            clock.timeline.lookup_sent_ms = clock.now_ms()
        self._own_saves.lookup_started(request.request_id)
        return pending

    def _lookup_blocks(self, request: Request) -> int:
        """Blocks of ``request`` a hit may cover: every full block; with state groups,
        those ending before its last token (a hit's end is a block boundary, where the
        state is, and vLLM computes at least one token)."""
        n = len(request.block_hashes)
        if self.info.space.state_groups:
            n = min(n, (request.num_tokens - 1) // self.block_size)
        return n

    def _clock(self, request: Request) -> RequestClock:
        return self._timelines.clock(request)

    def on_new_request(self, request: Request) -> None:
        """Start the lookup as the request arrives, so that it is usually answered by the
        time the scheduler first considers the request."""
        self._hashes.ensure()
        self._clock(request)
        if self.info.can_load and request.block_hashes and self._keys_known():
            self._start_lookup(request, 0)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        local = num_computed_tokens // self.block_size
        n = self._lookup_blocks(request)
        if not self.info.can_load or n <= local or not self._keys_known():
            self._admit(RequestState(request, local, next_save=local))
            self._so_far.requests += 1
            clock = self._clock(request)
            clock.timeline.admitted_ms = clock.now_ms()
            return 0, False
        pending = self._lookups.get(rid)
        if pending is None or pending.first_block > local:
            pending = self._start_lookup(request, local)
            if pending.answer is None:  # a call (the node's index answers at once)
                return self._wait_a_step(request)
        # A busy engine is never stalled: ask again next step. An idle one (the last step
        # ran nothing) has nothing to delay, so wait for the answer instead of spinning
        # empty steps: each one also keeps vLLM's worker busy-polling for a second, which
        # starves the Lookup and BackendClient actors (and, on a small host, the prefill a
        # PD wait is waiting for). A request arriving meanwhile is scheduled once the
        # answer is in: at most the lookup timeout, or pd_wait_ms for a PD wait.
        answer = self._lookups.poll(rid, pending, wait=not self._engine_busy)
        if answer is None:
            return self._wait_a_step(request)
        why, capped, refused = answer.miss, 0, 0
        if pending.timed_out:
            self._clock(request).timeline.lookup_timed_out = True
            hit = 0
        else:
            leading = answer.hits
            if pending.first_block + leading < local and pending.first_block < local:
                # The early lookup (from block 0) stopped inside vLLM's local hit: what
                # follows the local hit is still unknown, so look up from there.
                self._start_lookup(request, local)
                return self._wait_a_step(request)
            if self._awaits_own_save(request, pending.first_block + leading):
                return self._wait_a_step(request)
            if leading < pending.want:
                reported = pending.first_block + pending.want
                self._pd.blocks_missing(rid, reported, pending.first_block + leading)
            hit = max(0, pending.first_block + leading - local)
            failed = self._reqs[rid].failed_from if rid in self._reqs else None
            if failed is not None and local + hit > failed:  # (the index may lag behind)
                capped, hit = local + hit - max(failed, local), max(0, failed - local)
        # (a PD decode loads what its prefill computed for it, whatever the rates)
        estimate = None
        if hit and not pending.want:
            decision = self._decide_load(hit, min(answer.ssd, hit))
            estimate = decision.estimate
            if not decision.load:
                refused, hit = hit, 0
        clock = self._clock(request)
        clock.timeline.lookup_answered_ms = clock.now_ms()
        clock.timeline.admitted_ms = clock.timeline.lookup_answered_ms
        self.stats.add("lookup_us", int((time.monotonic() - pending.started) * 1e6))
        self.stats.add("lookups")
        self.stats.add("lookup_blocks", n - local)
        self.stats.add("lookup_hit_blocks", hit)
        for reason, count in (("load_failed", capped), ("not_worth_loading", refused)):
            if count:  # (the blocks after them keep the index's reason)
                self.stats.add(miss_counter(reason), count)
                self._lookups.count(miss_counter(reason), count)
                why = reason
        if n - local > hit + refused + capped:
            rest = n - local - hit - refused - capped
            self.stats.add(miss_counter(answer.miss or "not_stored"), rest)
        # A full hit still leaves the last token to compute: vLLM needs one new token.
        hit_tokens = min((local + hit) * self.block_size, request.num_tokens - 1)
        external = max(0, hit_tokens - num_computed_tokens)
        pool_blocks = -(-external // self.block_size) if external else 0
        miss = (why or "not_stored") if n - local > hit else ""
        if self._own_saves.expired(rid):  # (the counters keep the index's reason)
            miss = miss and "save_in_flight"
        ssd = min(answer.ssd, pool_blocks)
        left = request.num_tokens - hit_tokens
        if external:
            load_async = self._load_async(rid, pool_blocks, ssd, left, hit_tokens)
        else:
            load_async = False
            self._so_far.requests += 1
        self._admit(
            RequestState(
                request,
                local,
                pool_blocks=pool_blocks,
                next_save=local + pool_blocks + refused,  # (refused: the pool holds them)
                miss=miss,
                ssd_blocks=ssd,
                estimate=estimate,
                load_async=load_async,
            )
        )
        return external, load_async

    def _load_async(self, rid: str, blocks: int, ssd: int, tokens: int, context: int) -> bool:
        """Whether a hit of ``blocks`` blocks (``ssd`` of them only on the SSD tier), with
        ``tokens`` left to compute after ``context``, admitted now loads asynchronously
        (``load_async``). ``auto``: the step's first load is waited for before its
        forward (its request computes in the step); a further one joins it where this
        engine's rates say the waits of the step's requests and hits sum to less that way
        (:meth:`~kvray.connector.worth.Worth.joins_step`, which also counts the hits still
        to come: :meth:`~kvray.connector.lookup.Lookups.hits_to_come`), else it loads
        while the step computes and its request computes in a later step (so too while a
        rate is not measured yet)."""
        mode = self.info.config.load_async
        so_far = self._so_far
        cost = self._worth.hit_ms(blocks - ssd, ssd, tokens, context)
        if mode != "auto" or self.info.config.use_layerwise or not self._loads:
            joins = mode is not True  # false; auto's first hit of a step, or layerwise
        else:
            coming = self._lookups.hits_to_come(besides=rid)
            joins = bool(self._worth.joins_step(cost, so_far, coming))
            self.stats.add("loads_joined_step" if joins else "loads_beside_step")
        if joins:
            so_far.requests += 1
            so_far.loads += 1
            so_far.added_ms += sum(cost) if cost else 0.0
        else:
            so_far.beside += 1
        return not joins

    def _decide_load(self, blocks: int, ssd: int) -> Decision:
        """Load the hit, or compute it: measured to load slower than computing its
        tokens, a hit is computed (``recompute_slow_hits``; :mod:`kvray.connector.worth`)."""
        if not self.info.config.recompute_slow_hits:
            return Decision(True, None)
        return self._worth.decide(blocks, ssd, self.block_size)

    def _awaits_own_save(self, request: Request, block: int) -> bool:
        """The lookup missed at ``block``: ask again while this instance's own save of it
        is in flight (:class:`~kvray.connector.own_saves.OwnSaves`)."""
        hashes = request.block_hashes
        digest = hash_bytes(hashes[block]) if block < len(hashes) else None
        if not self._own_saves.awaits(request.request_id, digest):
            return False
        self.stats.add("lookup_save_waits")
        self._save_waiters = True
        return True  # the answer is dropped: the next step looks up again

    def _wait_a_step(self, request: Request) -> tuple[None, bool]:
        """The request sits out this step: its lookup is not answered yet."""
        self._clock(request).timeline.lookup_wait_steps += 1
        self.stats.add("lookup_wait_steps")
        return None, False

    def _admit(self, st: RequestState) -> None:
        prev = self._reqs.get(st.request.request_id)
        st.failed_from = prev.failed_from if prev is not None else None
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
            st = self._reqs[request.request_id] = RequestState(request, 0)
        st.set_blocks(blocks.get_block_ids())
        if num_external_tokens <= 0:
            return
        load_async = st.load_async
        self._worth.planned(
            request.request_id, st.pool_blocks, st.ssd_blocks, load_async=load_async
        )
        first, last = st.local_blocks, st.local_blocks + st.pool_blocks
        hashes = [hash_bytes(h) for h in request.block_hashes[first:last]]
        queue = self._async_loads if load_async else self._loads
        for g, ids in enumerate(st.group_ids):
            # A sliding window's blocks before its window are vLLM's null block: not loaded.
            op = group_op(request.request_id, hashes, ids[first:last], g)
            queue.append(op)
            if len(st.group_ids) == 1:  # (a hybrid model's failures are per request)
                for block_id in op.block_ids:
                    self._block_owner[block_id] = request.request_id

    # ---- per step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVRayMetadata:
        self._report_finished()  # those finished outside a step's output (aborts)
        self._hashes.check()
        scheduled = scheduler_output.num_scheduled_tokens
        self._engine_busy = bool(scheduled)
        self._so_far = StepSoFar(requests=len(scheduled))
        track_scheduled(self._reqs, scheduler_output)
        self._step += 1
        self._timelines.step_built(self._step, scheduled, self._reqs)
        self._worth.step_built(self._step, sum(scheduled.values()), step_pairs(scheduler_output))
        for op in self._loads:
            for block_id in op.block_ids:
                self._unverified[block_id] = self._step
        saves, self._late_saves = self._late_saves, []
        if self.info.can_save:
            states = self.info.space.state_groups
            planned = plan_saves(self._reqs, scheduled, self.block_size, self._unverified, states)
            planned += offered_states(self._reqs, scheduler_output, self.block_size)
            saves += self._pins.pin_windows(self._step, self.info.groups, self._warn_once, planned)
            if self._describer is not None:
                first_group = [op for op in planned if op.group == 0]
                self._describer.describe(first_group, self._reqs, self.info.space)
        self._own_saves.saving(self._step, tuple(h for op in saves for h in op.block_hashes))
        for rid in scheduler_output.preempted_req_ids or ():
            st = self._reqs.pop(rid, None)
            for block_id in st.block_ids if st else ():
                if self._block_owner.get(block_id) == rid:
                    del self._block_owner[block_id]
            self._preempted.append(rid)
        self._lookups.pin([h for op in (*self._loads, *self._async_loads) for h in op.block_hashes])
        self._lookups.report()
        idle = not any(scheduled.values())
        meta = KVRayMetadata(
            self._loads,
            self._async_loads,
            saves,
            self._delayed,
            self._preempted,
            self._step,
            self.info.space.generation,
            idle=idle,
            awaits_saves=idle and self._save_waiters,
        )
        self._save_waiters = False
        self._loads, self._async_loads, self._delayed, self._preempted = [], [], [], []
        return meta

    def reset_cache(self) -> bool:
        """vLLM's reset of the external cache (``/reset_prefix_cache?reset_external=true``,
        ``LLM.reset_prefix_cache(reset_connector=True)``, called after a weight update):
        from now on this engine's keys are those of a newer generation of its model's
        blocks (:meth:`kvray.pool_state.PoolState.reset_generation`), so no block stored
        before answers its lookups or loads; blocks its saves in flight store under the
        old keys are never read. The pool is shared, so other models' blocks, and the
        blocks of engines of this model that did not reset, stay. False: the pool did not
        answer (nothing changed)."""
        space = self.info.space
        keys = f"{space.namespace}@{space.layout}"
        try:
            gen = self._manager.reset_generation(keys, space.generation).result(
                self._call_timeout_s
            )
        except KVRayError as exc:
            logger.warning("kvray: resetting the pool's blocks of %s failed: %s", keys, exc)
            return False
        self.info = replace(self.info, space=replace(space, generation=gen))
        self._lookups.space = self.info.space
        self._pd.use_space(self.info.space)
        self._lookups.drop_all()
        self._own_saves = OwnSaves(self._own_saves.save_timeout_s, self._own_saves.index_lag_s)
        logger.info(
            "kvray: the pool's blocks of %s reset for this engine (generation %d): blocks "
            "stored before are never loaded again",
            keys,
            gen,
        )
        return True

    def bind_block_pool(self, pool: BlockPool) -> None:
        self._pins.bind(pool)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The external tokens by the tier that held them: ``disk`` for the SSD tier's
        (blocks the pool's DRAM did not hold at lookup), ``host`` for the rest."""
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return {}
        disk = min(st.ssd_blocks * self.block_size, num_external_tokens)
        counts = {"disk": disk, "host": num_external_tokens - disk}
        return {k: v for k, v in counts.items() if v}

    def loaded_groups(self) -> tuple[int, ...]:
        """The KV cache groups a load writes: every group (a sliding window's within its
        window, which is all vLLM allocates there)."""
        return tuple(range(max(1, len(self.info.groups))))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        times = getattr(output, "kv_connector_worker_meta", None)
        if output.finished_recving:
            self._timelines.async_loaded(output.finished_recving)
        if isinstance(times, StepTimes):
            self._timelines.async_served(times.async_served_ms)
            self._worth.async_served(times.async_served_ms)
            self._timelines.step_times(times)
            failed = bool(output.invalid_block_ids)
            self._worth.step_done(
                times.step, times.forward_ms, times.load_wait_ms, self.block_size, failed
            )
            if self._unverified:  # that step's failed loads are in this output
                self._unverified = {b: s for b, s in self._unverified.items() if s > times.step}
            self._own_saves.ended_through(times.saved_through)
            self._pins.release_through(times.saved_through)
        failed_recving = set(getattr(output, "failed_recving", None) or ())
        self._worth.async_done(set(output.finished_recving or ()), failed_recving)
        for rid in failed_recving:
            st = self._reqs.get(rid)
            if st is not None:  # vLLM recomputes it from its first token (or fails it)
                st.load_failed_blocks += st.pool_blocks
                st.failed_at(st.local_blocks)
        for rid in output.finished_sending or ():
            self._awaiting_frees.discard(rid)
        for block_id in output.invalid_block_ids or ():
            owner = self._block_owner.get(block_id)
            st = self._reqs.get(owner) if owner else None
            if st is None and owner in self._errored:
                self._errored[owner][0].load_failed_blocks += 1
            elif st is not None:
                st.load_failed_blocks += 1
                if block_id in st.block_ids:  # vLLM recomputes from the first failed one
                    st.failed_at(st.block_ids.index(block_id))
        self._report_finished()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with every KV cache group's blocks (vLLM's now: a sliding
        window's left-behind blocks already its null block, never saved late)."""
        st = self._reqs.get(request.request_id)
        if st is not None and st.group_ids and len(block_ids) == len(st.group_ids):
            st.set_blocks(block_ids)
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._lookups.drop(rid)
        self._own_saves.forget(rid)
        self._worth.forget(rid)
        self._lookups.report(finished=True)  # (sent soon after, off the request's path)
        st = self._reqs.pop(rid, None)
        if st is not None and self.info.can_save and not ended_in_error(request):
            # Saves held for loads not yet known good. vLLM finishes a request only once
            # its loads did not fail (a failed one is recomputed first), so they are good
            # now; one aborted meanwhile may still sit on a failed load: dropped.
            held = () if finished_normally(request) else self._unverified
            states = self.info.space.state_groups
            late = plan_saves({rid: st}, (rid,), self.block_size, held, states)
            self._late_saves += self._pins.pin_windows(
                self._step, self.info.groups, self._warn_once, late
            )
            if self._describer is not None:
                first_group = [op for op in late if op.group == 0]
                self._describer.describe(first_group, {rid: st}, self.info.space)
        self._timelines.finished(rid, st)
        if st is None:
            self._release_blocks(rid, block_ids)
            return False, None
        if st.pool_blocks and ended_in_error(request):
            # reported with this step's failed loads (update_connector_output)
            self._errored[rid] = (st, len(request.block_hashes), list(block_ids))
        else:
            self._release_blocks(rid, block_ids)
            self._log_request(rid, st, len(request.block_hashes))
        params = self._pd.for_decode(request, st.next_save)
        if not st.saves_issued:
            return False, params
        # Keep the blocks until every worker reports its saves of them done.
        self._delayed.append(rid)
        self._awaiting_frees.add(rid)
        return True, params

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
    def _log_request(rid: str, st: RequestState, total: int) -> None:
        hit, loaded, failed = st.totals()
        est = st.estimate
        line = RequestLine(
            rid, total, st.local_blocks, hit, loaded, failed, st.saved_blocks, miss=st.miss,
            est_load_ms=None if est is None else round(est.load_ms, 2),
            est_compute_ms=None if est is None else round(est.compute_ms, 2),
        )  # fmt: skip
        log_request(logger, line)

    def shutdown(self) -> None:
        """The engine stops: the lookup counters not yet sent go to the pool."""
        self._lookups.close()

    def has_pending_push_work(self) -> bool:
        # (pinned blocks: their saves' end is only known through a later step's output)
        return bool(self._awaiting_frees or self._delayed or self._pins.held)
