"""Scheduler side: what is tracked per request, from admission to finish, and the saves
each step's metadata asks of the workers (prompt blocks the step completes that the pool
does not hold yet)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvray.connector.kv_groups import NULL_BLOCK
from kvray.connector.metadata import BlockOp
from kvray.connector.worth import Estimate, attention_pairs

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def hash_bytes(h: Any) -> bytes:
    """vLLM's block hashes are bytes (sha256); non-crypto algorithms give ints."""
    return h if isinstance(h, bytes) else int(h).to_bytes(16, "little", signed=True)


@dataclass
class RequestState:
    """One admitted request."""

    request: Request
    local_blocks: int
    """Leading blocks vLLM's own prefix cache had."""
    pool_blocks: int = 0
    """Leading blocks after those that the pool had (and that get loaded)."""
    group_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's block ids (one list for most models; a sliding
    window group's entries that left the window are vLLM's freed blocks, or its null
    block where it allocated none)."""
    next_save: int = 0
    """First block not yet stored (or known to be in the pool)."""
    computed_tokens: int = 0
    saves_issued: bool = False
    saved_blocks: int = 0
    load_failed_blocks: int = 0
    failed_from: int | None = None
    """The first block whose load failed (vLLM recomputes from there): a later lookup of
    this request takes no hit from it on."""
    earlier: tuple[int, int, int] = (0, 0, 0)
    """(hit, loaded, failed) pool blocks of earlier admissions of this request (a failed
    load or a preemption sends it through lookup again)."""
    miss: str = ""
    """Why its lookup stopped short of its last full block (kvray.misses' reasons; empty:
    a whole hit, or no lookup)."""
    ssd_blocks: int = 0
    """Of the pool blocks, how many only the SSD tier held at lookup."""
    estimate: Estimate | None = None
    """What loading the pool hit and computing it were estimated to cost when it was
    weighed (:mod:`kvray.connector.worth`; None: not weighed)."""
    load_async: bool = False
    """Its pool hit loads asynchronously (decided at lookup: ``load_async``)."""

    @property
    def block_ids(self) -> list[int]:
        """The first KV cache group's block ids (a model of one group: its blocks)."""
        return self.group_ids[0] if self.group_ids else []

    def failed_at(self, block: int) -> None:
        """Its load failed from ``block`` on (vLLM recomputes from there): those blocks are
        stored again, and a later lookup of it takes no hit from there on."""
        self.next_save = min(self.next_save, block)
        self.failed_from = block if self.failed_from is None else min(self.failed_from, block)

    def set_blocks(self, ids: tuple[list[int], ...] | list[list[int]]) -> None:
        self.group_ids = [list(g) for g in ids]

    def add_blocks(self, ids: tuple[list[int], ...] | list[list[int]]) -> None:
        if not self.group_ids:
            self.set_blocks(ids)
            return
        for mine, new in zip(self.group_ids, ids, strict=True):
            mine.extend(new)

    def totals(self) -> tuple[int, int, int]:
        hit, loaded, failed = self.earlier
        return (
            max(hit, self.pool_blocks),
            loaded + self.pool_blocks - self.load_failed_blocks,
            failed + self.load_failed_blocks,
        )


def track_scheduled(reqs: dict[str, RequestState], output: SchedulerOutput) -> None:
    """The blocks and computed tokens of the requests ``output`` schedules."""
    scheduled = output.num_scheduled_tokens
    for new in output.scheduled_new_reqs:
        st = reqs.get(new.req_id)
        if st is not None:
            st.set_blocks(new.block_ids)
            st.computed_tokens = new.num_computed_tokens + scheduled.get(new.req_id, 0)
    cached = output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        st = reqs.get(rid)
        if st is None:
            continue
        new_ids = cached.new_block_ids[i]
        if rid in cached.resumed_req_ids and new_ids is not None:
            st.set_blocks(new_ids)
        elif new_ids is not None:
            st.add_blocks(new_ids)
        st.computed_tokens = cached.num_computed_tokens[i] + scheduled.get(rid, 0)


def step_pairs(output: SchedulerOutput) -> float:
    """The attention pairs (:func:`~kvray.connector.worth.attention_pairs`) of the tokens
    ``output`` schedules, over every request it schedules."""
    scheduled = output.num_scheduled_tokens
    pairs = sum(
        attention_pairs(scheduled.get(new.req_id, 0), new.num_computed_tokens)
        for new in output.scheduled_new_reqs
    )
    cached = output.scheduled_cached_reqs
    return pairs + sum(
        attention_pairs(scheduled.get(rid, 0), computed)
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
    )


def plan_saves(
    reqs: dict[str, RequestState],
    scheduled: Iterable[str],
    block_size: int,
    unverified: Container[int] = (),
    state_groups: Container[int] = (),
) -> list[BlockOp]:
    """Prompt blocks completed (by this step or, held, earlier) and not yet in the pool.

    ``unverified``: block ids a sync load wrote in a step whose outcome is not back yet. A
    request with any of them among its computed blocks saves nothing now: if that load
    failed, the forward attended to what the block held before, and every block it
    computed after it is wrong (vLLM recomputes them; the pool must not keep them). Its
    saves are planned once the loads are known good (``next_save`` does not move).

    A hybrid model's blocks are saved in every KV cache group (one op per group), sliding
    windows too: every block a step computed is still allocated when the step's saves are
    planned (the scheduler pins those vLLM would free mid-request until their saves end);
    a null block (a window's block vLLM no longer holds) is never saved."""
    saves = []
    for rid in scheduled:
        st = reqs.get(rid)
        if st is None:
            continue
        req = st.request
        full = min(st.computed_tokens, req.num_prompt_tokens) // block_size
        full = min(full, len(req.block_hashes), *(len(ids) for ids in st.group_ids or [[]]))
        if full <= st.next_save:
            continue
        if unverified and any(b in unverified for b in st.block_ids[:full]):
            continue
        hashes = [hash_bytes(h) for h in req.block_hashes[st.next_save : full]]
        for g, ids in enumerate(st.group_ids):
            if g in state_groups:  # saved as vLLM offers them (offered_states), never by position
                continue
            op = group_op(rid, hashes, ids[st.next_save : full], g)
            if op.block_ids:
                saves.append(op)
        st.saved_blocks += full - st.next_save
        st.next_save = full
        st.saves_issued = True
    return saves


def group_op(rid: str, hashes: Sequence[bytes], ids: Sequence[int], group: int) -> BlockOp:
    """The blocks ``ids`` (one per hash of ``hashes``) of KV cache group ``group``, but
    vLLM's null block (where a sliding window keeps none)."""
    keep = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
    return BlockOp(rid, tuple(hashes[i] for i in keep), tuple(ids[i] for i in keep), group)


def offered_states(
    reqs: dict[str, RequestState], output: SchedulerOutput, block_size: int
) -> list[BlockOp]:
    """The recurrent states (Mamba, linear attention) the step computes at block
    boundaries of its requests' prompts, as vLLM offers them to the connector
    (``kv_connector_block_state.boundary_state_offloads``: KV cache group, block id, tokens
    before the boundary). The state after ``T`` tokens is keyed by the hash of the block
    ending at ``T``; a state inside a pool hit (loaded) is not saved again."""
    state = getattr(output, "kv_connector_block_state", None)
    offers = getattr(state, "boundary_state_offloads", None) or {}
    ops = []
    for rid, entries in offers.items():
        st = reqs.get(rid)
        if st is None:
            continue
        req = st.request
        loaded = st.local_blocks + st.pool_blocks if st.pool_blocks else 0
        for group, block_id, tokens in entries:
            end, rest = divmod(int(tokens), block_size)
            if rest or not loaded < end <= min(
                len(req.block_hashes), req.num_prompt_tokens // block_size
            ):
                continue
            ops.append(
                BlockOp(
                    rid,
                    (hash_bytes(req.block_hashes[end - 1]),),
                    (int(block_id),),
                    group=int(group),
                )
            )
    return ops


def ended_in_error(request: Request) -> bool:
    """Ended by an error (vLLM's ``FINISHED_ERROR``)."""
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.FINISHED_ERROR


def finished_normally(request: Request) -> bool:
    """Ended by its own output (a stop, its length), in vLLM's handling of a step's output:
    after that step's failed loads were known."""
    from vllm.v1.request import RequestStatus

    return request.status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        getattr(RequestStatus, "FINISHED_REPETITION", RequestStatus.FINISHED_STOPPED),
    )
