"""KVRayConnector on real vLLM engines: loads are byte-exact (greedy outputs equal a run
without the connector), only shared prefixes load, blocks one engine stored load in
another, and a failed load recomputes or fails the request as the policy says. Most tests
run in both placements: ``shared`` (the KV cache is the shared region) and ``staged``
(blocks go through a staging region: the GPU/NPU code path, on CPU tensors); blocks one
placement stored load in the other.

The engines are shared (the session's ``engines``: one live engine per connector config,
one key namespace for all): each test has prompts of its own (``own_prompts``), and every
hit it claims is checked to have come from the pool (``pool_hit``: vLLM's own prefix
cache is off in these engines, and the connector's line counts its blocks). Fresh engine
processes only where the process is the point: SIGKILL, and hash seeds.
"""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

from kvray.connector.log_lines import request_lines
from kvray.shm import mapped_regions
from kvray.testing.engine import LiveEngine

from .conftest import (
    BLOCK,
    P1,
    assert_no_region_left,
    engine_env,
    engine_spec,
    logged_key_space,
    own_prompts,
    pool_hit,
    run_engine,
)
from .conftest import connector as _connector

pytestmark = pytest.mark.e2e
NAMESPACE = "tiny-e2e"
"""Every engine of this module keys its blocks here (both placements: one key layout)."""
BLOCK_BYTES = 2 * 2 * 128 * 4 * 64 * 4
"""One block of the tiny Llama: K and V, 2 layers, 128 tokens x 4 heads x 64, float32."""


@pytest.fixture(scope="module", params=["shared", "staged"])
def placement(request):  # type: ignore[no-untyped-def]
    return request.param


def spec(  # type: ignore[no-untyped-def]
    tiny_model: str, placement: str, *, policy: str = "recompute", defaults: bool = False, **extra
) -> dict:
    """A shared engine's spec: KVRayConnector in ``placement`` on the module's pool, its
    drop hook ready (armed per request batch), timelines collected. ``defaults``: the
    connector's own lookup timeout, not the suite's."""
    extra = {"kv_placement": placement, "model_namespace": NAMESPACE, "load_async": False, **extra}
    conn = _connector(**extra)
    if defaults:
        del conn["extra"]["lookup_timeout_ms"]
    return {
        "model": tiny_model,
        "connector": {**conn, "policy": policy},
        "drop_hook": True,
        "timelines": True,
    }


def prompt_set(request):  # type: ignore[no-untyped-def]
    """This test's p1 (4 full blocks and a partial one), p2 (its first 2 blocks shared
    with p1, then another) and p3 (3 full blocks and a partial one, nothing shared)."""
    shared = own_prompts(request, 2 * BLOCK, salt="shared")
    return (
        own_prompts(request, 4 * BLOCK + 40, salt="p1", shared=shared),
        own_prompts(request, 3 * BLOCK + 10, salt="p2", shared=shared),
        own_prompts(request, 3 * BLOCK + 5, salt="p3"),
    )


def test_save_then_load_matches_baseline(pool, engines, reference, tiny_model, request, placement):
    """As users send them: the connector's default lookup timeout, and each prompt sent as
    soon as the previous answer is back, while its saves may still be in flight (a lookup
    waits for this instance's own saves): the repeat loads every stored block."""
    p1, p2, _ = prompt_set(request)
    eng = engines.get(spec(tiny_model, placement, defaults=True))
    before = pool.stats().total
    runs = [eng.generate([p], wait_saves=False) for p in (p1, p1, p2)]
    assert [r["outputs"][0] for r in runs] == reference([p1, p1, p2])
    lines = [line for r in runs for line in r["lines"]]
    assert len(lines) == 3
    # 1st: nothing in the pool, 4 full blocks saved. 2nd: all 4 loaded (prefix caching is
    # off, so only the pool can serve them). p2: only the 2 shared blocks load.
    assert {k: v for k, v in lines[0].items() if k != "request_id"} == {
        "total_blocks": 4,
        "hit_local": 0,
        "hit_pool": 0,
        "loaded": 0,
        "failed": 0,
        "saved": 4,
    }
    pool_hit(lines[1], 4)
    assert lines[1]["saved"] == 0
    pool_hit(lines[2], 2)
    assert lines[2]["saved"] == 1
    eng.call(op="drain")  # the last saves ended: the pool's counters have them
    after = pool.stats().total
    assert after.get_keys - before.get_keys >= 6 and after.put_keys - before.put_keys >= 5
    assert f"{placement} placement" in eng.log(), eng.log()[-3000:]
    # Per-request timelines: every stage stamped, in order; the hit waited for its load.
    timelines = [t for r in runs for t in r["timelines"]]
    assert len(timelines) == 3
    for tl in timelines:
        stamps = [tl[k] for k in ("lookup_sent_ms", "lookup_answered_ms", "admitted_ms",
                                  "first_step_built_ms", "first_token_ms")]  # fmt: skip
        assert None not in stamps and stamps == sorted(stamps), tl
        assert tl["forward_ms"] > 0 and tl["prefill_steps"] == 1, tl
    hit = timelines[1]
    assert (hit["hit_pool"], hit["loaded"]) == (4, 4) and hit["load_wait_ms"] > 0, hit
    assert timelines[0]["load_wait_ms"] == 0.0


def test_async_engine_loads_what_another_engine_stored(
    pool, engines, reference, tiny_model, request, placement
):
    """Another engine process, with async loads and its transfers as Ray calls (the
    fallback path), hits what the first one saved over its node channel."""
    p1, _, _ = prompt_set(request)
    first = engines.get(spec(tiny_model, placement))
    first.generate([p1])
    ray_path = engines.get(spec(tiny_model, placement, **ASYNC))
    out = ray_path.generate([p1])
    assert out["outputs"] == reference([p1])
    (line,) = out["lines"]
    pool_hit(line, 4)
    assert "transfers over the node channel" in first.log(), first.log()[-3000:]
    assert "transfers over Ray calls" in ray_path.log(), ray_path.log()[-3000:]


def stored_then_dropped(engines, tiny_model, placement, prompt, **load):  # type: ignore[no-untyped-def]
    """``prompt``'s blocks stored by one engine, then ``prompt`` on the engine of ``load``
    (spec options), whose hit blocks are removed from the pool between its lookup and its
    load."""
    engines.get(spec(tiny_model, placement)).generate([prompt])
    return engines.get(spec(tiny_model, placement, **load)).generate([prompt], drop=True)


ASYNC = {"load_async": True, "transfer_channel": "ray"}
"""The async-load engine's options: its transfers go as Ray calls (the fallback path is
tested on its own; the other engines use the node channel)."""


@pytest.mark.parametrize("load_async", [False, True])
def test_failed_load_recomputes(
    pool, engines, reference, tiny_model, request, load_async, placement
):
    _, _, p3 = prompt_set(request)
    load = ASYNC if load_async else {"load_async": False}
    out = stored_then_dropped(engines, tiny_model, placement, p3, **load)
    assert out["outputs"] == reference([p3])
    (line,) = out["lines"]
    # Async: the failed request goes through lookup again (now a miss), is recomputed,
    # and stores the lost blocks again; sync: vLLM recomputes from the failed block.
    assert (line["hit_pool"], line["failed"], line["loaded"], line["saved"]) == (3, 3, 0, 3)


def test_failed_load_fails_request_under_fail_policy(pool, engines, tiny_model, request, placement):
    _, _, p3 = prompt_set(request)
    out = stored_then_dropped(engines, tiny_model, placement, p3, policy="fail")
    assert out["finish_reasons"] == ["error"]


def test_sigkilled_engine_leaves_no_region(
    pool, ray_cluster, engines, reference, tiny_model, tmp_path, request, placement
):
    """An engine killed with SIGKILL (OOM killer, node drain) runs no exit handler: its
    region (the 1 GiB KV cache when shared, the staging region when staged) must still
    not outlive it, neither as a /dev/shm file nor as memory the rank's BackendClient
    actor keeps mapped. What it saved stays a hit for the engines after it: the pool
    outlives the engine."""
    _, _, p3 = prompt_set(request)
    killed = LiveEngine(
        "killed",
        engine_spec(spec(tiny_model, placement)),
        engine_env(ray_cluster),
        tmp_path,
        fork=True,
    )
    try:
        killed.wait_ready()
        killed.generate([p3])  # its saves drained: the actor has mapped the region
        prefix = "kvray-e2e-kv-" if placement == "shared" else "kvray-e2e-stage-"
        regions = [n for names in mapped_regions(prefix).values() for n in names]
        assert any(n.startswith(f"{prefix}{killed.proc.pid}-") for n in regions), regions
    finally:
        killed.proc.kill()
        killed.proc.wait(60)
        killed.close()
    assert killed.proc.returncode == -signal.SIGKILL
    assert_no_region_left("a SIGKILLed engine")
    out = engines.get(spec(tiny_model, placement)).generate([p3])
    assert out["outputs"] == reference([p3])
    (line,) = out["lines"]
    pool_hit(line, 3)


def test_staged_loads_what_shared_stored(pool, engines, reference, tiny_model, request):
    """One key layout for both placements: the bytes a staged engine gathers are the
    blocks a shared engine stored, so it loads them and generates the same tokens."""
    p1, _, _ = prompt_set(request)
    engines.get(spec(tiny_model, "shared")).generate([p1])
    out = engines.get(spec(tiny_model, "staged")).generate([p1])
    assert out["outputs"] == reference([p1])
    (line,) = out["lines"]
    pool_hit(line, 4)


@pytest.mark.timeout(600)  # engines in fresh interpreters, one after the other
def test_hash_seed_mismatch_is_named_and_never_hits(
    pool, ray_cluster, tiny_model, baseline, tmp_path
):
    """Real engines with different PYTHONHASHSEEDs (vLLM's NONE_HASH seed) derive other
    block hashes for the same tokens: the second one gets no hit (never wrong bytes), and
    says why at attach (and so does ``kvray status``); the same seed hits. Fresh
    interpreters (not forked from the engines' fork server): the hash seed is the
    process's."""
    spec = {"model": tiny_model, "runs": [[P1]], "fork": False,
            "connector": _connector(model_namespace="tiny-seeds", load_async=False)}  # fmt: skip
    a = run_engine(ray_cluster, tmp_path, "seed-1", {
        **spec, "env": {"PYTHONHASHSEED": "1"}, "wait_saves_for": "e2e"})  # fmt: skip
    same = run_engine(ray_cluster, tmp_path, "seed-1-again", {
        **spec, "env": {"PYTHONHASHSEED": "1"}})  # fmt: skip
    other = run_engine(ray_cluster, tmp_path, "seed-2", {
        **spec, "env": {"PYTHONHASHSEED": "2"}})  # fmt: skip
    for out in (a, same, other):
        assert out["runs"][0]["outputs"][0] == baseline["P1"]
    hits = [(o["runs"][0]["lines"][0]["hit_pool"], o["runs"][0]["lines"][0]["loaded"])
            for o in (a, same, other)]  # fmt: skip
    assert hits == [(0, 0), (4, 4), (0, 0)], hits
    assert "hashed differently" not in a["log"] + same["log"]
    assert "hashed differently" in other["log"] and "PYTHONHASHSEED" in other["log"], other["log"][
        -3000:
    ]
    mismatches = pool.stats().hash_mismatches()
    (domains,) = [v for k, v in mismatches.items() if k.startswith("tiny-seeds@")]
    assert sorted(d["instances"] for d in domains) == [1, 2]
    assert {d["seed_source"] for d in domains} == {"PYTHONHASHSEED"}
    assert "HASH MISMATCH for tiny-seeds@" in pool.stats().table()


def _stored_keys(eng: LiveEngine, prompt: list[int]) -> list[str]:  # type: ignore[no-untyped-def]
    """The pool keys of ``prompt``'s 4 full blocks, stored by ``eng``."""
    stored = eng.generate([prompt])
    hashes = [bytes.fromhex(h) for h in stored["block_hashes"][0][:4]]
    assert len(hashes) == 4, stored["block_hashes"]
    space = logged_key_space(eng.log())
    assert (space.namespace, space.layout) == (NAMESPACE, "float32-b128-h4x64")  # tiny Llama's
    return space.lookup_key_strs(hashes)


def test_negative_control_corrupted_blocks_change_the_output(
    pool, engines, reference, tiny_model, request
):
    """The oracle can see wrong bytes: blocks overwritten behind kvray's back (same keys,
    same sizes, other values) are loaded as hits and the engine's greedy output differs
    from the run without the connector. Every "outputs equal the baseline" assertion in
    these tests rests on this: with this model and these prompts, wrong KV bytes show."""
    p1, _, _ = prompt_set(request)
    eng = engines.get(spec(tiny_model, "shared"))
    keys = _stored_keys(eng, p1)
    assert all(pool.exists(keys)), "the first run did not store p1's 4 blocks"
    rng = np.random.default_rng(0)
    for key in keys:
        real = pool.get(key, shape=(BLOCK_BYTES // 4,), dtype=np.float32)
        assert real is not None
        wrong = rng.permutation(real) * np.float32(3.0)  # plausible values, wrong places
        pool.put(key, wrong.astype(np.float32), overwrite=True)
    loaded = eng.generate([p1])
    (line,) = loaded["lines"]
    pool_hit(line, 4)
    assert loaded["outputs"] != reference([p1]), (
        "corrupted KV blocks gave the baseline's tokens: the output oracle cannot see "
        "wrong bytes with this model and prompt"
    )


def test_bytes_corrupted_inside_the_pool_fail_their_checksum_and_are_recomputed(
    pool, engines, reference, tiny_model, request
):
    """The negative control's blocks, but changed inside the backend (one bit of each
    value, through a client without checksums, the trailer left as it was): the load
    verifies every block before vLLM may use it, so all four are reported failed and
    recomputed (the baseline's tokens, where the control above got other tokens), counted
    as corrupt, and removed from the pool; the recomputed blocks are stored again, and the
    next request loads those."""
    from kvray.backends import make_backend
    from kvray.backends.base import KeyStatus

    p1, _, _ = prompt_set(request)
    eng = engines.get(spec(tiny_model, "shared"))
    keys = _stored_keys(eng, p1)
    value = BLOCK_BYTES + 8  # and the trailer

    async def flip_one_bit_each() -> None:
        client = make_backend(pool.config, pool.server_address, contribute_memory=False)
        raw = client.inner  # type: ignore[attr-defined]  (the checksummed client's backend)
        buf = np.zeros(value, np.uint8)
        await raw.register_region(buf.ctypes.data, value)
        try:
            for key in keys:
                assert await raw.get([key], [[buf.ctypes.data]], [[value]]) == [KeyStatus.OK]
                buf[1000] ^= 0x04
                (st,) = await raw.put([key], [[buf.ctypes.data]], [[value]], overwrite=True)
                assert st is KeyStatus.OK
        finally:
            await raw.unregister_region(buf.ctypes.data)
            await client.close()

    before = pool.stats().total
    asyncio.run(flip_one_bit_each())
    loaded = eng.generate([p1])
    assert loaded["outputs"] == reference([p1])
    (line,) = loaded["lines"]
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 0, 4), line
    after = pool.stats().total
    assert after.get_corrupt - before.get_corrupt == 4
    assert after.misses()["corrupt"] - before.misses().get("corrupt", 0) >= 4
    # The bad values were removed and the recomputed blocks stored again: the next
    # request loads all four, verified, and gets the baseline's tokens.
    again = eng.generate([p1])
    assert again["outputs"] == reference([p1])
    (line,) = again["lines"]
    pool_hit(line, 4)
    assert pool.stats().total.get_corrupt - before.get_corrupt == 4


def _layerwise_keys(log: str, hashes: list[str], groups: int):  # type: ignore[no-untyped-def]
    """The engine's keys (its logged namespace, layout and geometries) with ``groups``
    layer groups per block."""
    space = logged_key_space(log, layer_groups=groups)
    return space.lookup_key_strs([bytes.fromhex(h) for h in hashes])


def layerwise(tiny_model: str, placement: str) -> dict:
    """use_layerwise, 2 layer groups, under a namespace of its own (its keys differ)."""
    return spec(tiny_model, placement, use_layerwise=True, layerwise_groups=2,
                model_namespace=f"tiny-lw-{placement}")  # fmt: skip


def test_layerwise_save_then_load(pool, engines, reference, tiny_model, request, placement):
    """use_layerwise: each block is one key per layer group; the second run loads them
    group by group (waited for in wait_for_layer_load: had the forward not waited, the
    blocks would be reported failed, not loaded) and generates the baseline tokens. An
    engine without use_layerwise shares none of these keys."""
    p1, _, _ = prompt_set(request)
    eng = engines.get(layerwise(tiny_model, placement))
    runs = [eng.generate([p1]) for _ in range(2)]
    assert [r["outputs"][0] for r in runs] == reference([p1, p1])
    (first,), (second,) = (r["lines"] for r in runs)
    assert (first["hit_pool"], first["saved"]) == (0, 4)
    pool_hit(second, 4)
    log = eng.log()
    assert "layer-wise transfers, 2 layer groups of [1, 1] layers" in log
    hashes = runs[0]["block_hashes"][0][:4]
    assert len(hashes) == 4, runs[0]["block_hashes"]
    assert logged_key_space(log).namespace == f"tiny-lw-{placement}"
    assert all(pool.exists(_layerwise_keys(log, hashes, 2)))
    assert not any(pool.exists(_layerwise_keys(log, hashes, 1)))
    if placement == "shared":
        return
    plain = spec(tiny_model, placement, model_namespace=f"tiny-lw-{placement}")
    out = engines.get(plain).generate([p1])
    assert out["outputs"] == reference([p1])
    (line,) = out["lines"]
    assert line["hit_pool"] == 0


def test_layerwise_without_layer_hooks_recomputes(
    pool, engines, reference, tiny_model, request, placement
):
    """An engine that never calls wait_for_layer_load: the loaded bytes arrive after the
    forward read the cache, so the step's hits are reported failed and recomputed (same
    tokens), never used."""
    p1, _, _ = prompt_set(request)
    eng = engines.get(layerwise(tiny_model, placement))
    runs = [eng.generate([p1], skip_layer_hooks=True) for _ in range(2)]
    assert [r["outputs"][0] for r in runs] == reference([p1, p1])
    (first,), (second,) = (r["lines"] for r in runs)
    assert (first["hit_pool"], first["saved"]) == (0, 4)
    assert (second["hit_pool"], second["loaded"], second["failed"]) == (4, 0, 4)
    assert "without calling wait_for_layer_load" in eng.log()


def test_reset_external_moves_the_engine_past_every_block_stored_before(
    pool, engines, reference, tiny_model, request
):
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (``/reset_prefix_cache?
    reset_external=true``, after a weight update): the pool's blocks stored before never
    answer this engine again (the repeat computes, same tokens, and stores anew), and what
    it stores after the reset hits. An engine of its own (a reset moves the engine's keys
    to a new generation: the shared engines keep theirs)."""
    p1, _, _ = prompt_set(request)
    eng = engines.get(spec(tiny_model, "shared", model_namespace="tiny-e2e-reset"))
    eng.generate([p1])
    pool_hit(eng.generate([p1])["lines"][0], 4)
    assert eng.call(op="reset_prefix_cache", external=True) == {"reset": True}
    after = eng.generate([p1])
    assert after["outputs"] == reference([p1])
    (line,) = after["lines"]
    assert (line["hit_pool"], line["loaded"], line["saved"]) == (0, 0, 4), line
    assert "reset for this engine (generation 1)" in eng.log(), eng.log()[-3000:]
    again = eng.generate([p1])
    assert again["outputs"] == reference([p1])
    pool_hit(again["lines"][0], 4)


LEARN_PROMPTS = 40
"""Prompts (each sent twice) within which the engine must have measured both rates: it
needs 8 loads and 8 steps at two sizes each (kvray/connector/worth.py)."""
WEIGHED_REPEATS = 6
"""Repeats weighed against computing them before the test stops looking for one computed."""


def test_a_hit_is_loaded_or_computed_as_the_engines_measured_rates_say(
    pool, engines, reference, tiny_model, request
):
    """``recompute_slow_hits`` as users get it (on). Repeats of prompts of 1 to 4 blocks
    load their hits while the engine measures both rates; from then on each repeat's hit is
    weighed, and its line says what loading it and computing it were estimated to cost.
    Then single-block repeats, the shortest hits, the likeliest computed: a hit estimated
    slower to load than to compute is computed (``miss=not_worth_loading``, nothing loaded),
    one estimated faster is loaded. Every output is that of an engine without the pool, and
    no load fails.

    Which way the tiny model's hits go is this machine's to measure (the unit tests in
    test_scheduler_worth.py fix the rates); here the decision must follow the engine's own
    estimates, whichever they are."""
    eng = engines.get(spec(tiny_model, "shared", recompute_slow_hits=True))
    repeats = []
    weighed = 0
    for i in range(LEARN_PROMPTS + WEIGHED_REPEATS):
        blocks = 1 if weighed else 1 + i % 4
        p = own_prompts(request, blocks * BLOCK + 3, salt=str(i))
        for _ in range(2):
            assert eng.generate([p])["outputs"][0] == reference([p])[0]
        repeat = request_lines(eng.log())[-1]
        repeats.append((blocks, repeat))
        weighed += repeat.est_load_ms is not None
        if repeat.miss == "not_worth_loading" or weighed == WEIGHED_REPEATS:
            break
    assert len(request_lines(eng.log())) == 2 * len(repeats)
    assert weighed, f"the rates were not measured in {LEARN_PROMPTS} prompts: {repeats[-4:]}"
    assert sum(ln.loaded for _, ln in repeats) >= 8  # the hits it measured were loaded
    for blocks, ln in repeats:
        assert ln.failed == 0 and ln.hit_local == 0, ln
        if ln.est_load_ms is None or ln.est_compute_ms is None:
            assert (ln.hit_pool, ln.loaded, ln.miss) == (blocks, blocks, ""), ln  # not weighed
        elif ln.miss == "not_worth_loading":
            assert ln.est_load_ms >= ln.est_compute_ms and (ln.hit_pool, ln.loaded) == (0, 0), ln
        else:
            assert ln.est_load_ms <= ln.est_compute_ms, ln  # (the 2-decimal print may tie)
            assert (ln.hit_pool, ln.loaded, ln.miss) == (blocks, blocks, ""), ln
