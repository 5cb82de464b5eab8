"""KVRayConnector on real vLLM engines: loads are byte-exact (greedy outputs equal a run
without the connector), only shared prefixes load, the pool outlives engines, and a
failed load recomputes or fails the request as the policy says. Every test runs in both
placements: ``shared`` (the KV cache is the shared region) and ``staged`` (blocks go
through a staging region: the GPU/NPU code path, on CPU tensors), each under its own key
namespace; and blocks one placement stored load in the other."""

from __future__ import annotations

import signal

import pytest

from kvray.connector.log_lines import request_counts
from kvray.shm import mapped_regions

from .conftest import (
    P1,
    P2,
    P3,
    assert_no_region_left,
    logged_key_space,
    run_engine,
    start_engine,
)
from .conftest import connector as _connector

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["shared", "staged"])
def placement(request):  # type: ignore[no-untyped-def]
    return request.param


@pytest.fixture
def connector(placement):  # type: ignore[no-untyped-def]
    """The e2e connector config in this placement, under its own namespace (both run on
    one pool: each group of tests starts from an empty namespace)."""

    def make(**extra):  # type: ignore[no-untyped-def]
        return _connector(kv_placement=placement, model_namespace=f"tiny-{placement}", **extra)

    return make


def test_save_then_load_matches_baseline(
    pool, ray_cluster, tiny_model, baseline, tmp_path, connector, placement
):
    out = run_engine(
        ray_cluster,
        tmp_path,
        "first",
        {
            "model": tiny_model,
            "connector": connector(load_async=False),
            "runs": [[P1], [P1], [P2]],
            "wait_saves_for": "e2e",
            "timelines": True,
        },
    )
    runs = out["runs"]
    assert [r["outputs"][0] for r in runs] == [baseline["P1"], baseline["P1"], baseline["P2"]]
    lines = request_counts(out["log"])
    assert len(lines) == 3
    # 1st: nothing in the pool, 4 full blocks saved. 2nd: all 4 loaded (prefix caching is
    # off, so only the pool can serve them). P2: only the 2 shared blocks load.
    assert lines[0] == {
        "total_blocks": 4,
        "hit_local": 0,
        "hit_pool": 0,
        "loaded": 0,
        "failed": 0,
        "saved": 4,
    }
    assert lines[1]["hit_pool"] == 4 and lines[1]["loaded"] == 4 and lines[1]["saved"] == 0
    assert lines[2]["hit_pool"] == 2 and lines[2]["loaded"] == 2 and lines[2]["saved"] == 1
    stats = pool.stats().total
    assert stats.get_keys >= 6 and stats.put_keys >= 5
    assert f"{placement} placement" in out["log"], out["log"][-3000:]
    # Per-request timelines: every stage stamped, in order; the hit waited for its load.
    assert len(out["timelines"]) == 3
    for tl in out["timelines"]:
        stamps = [tl[k] for k in ("lookup_sent_ms", "lookup_answered_ms", "admitted_ms",
                                  "first_step_built_ms", "first_token_ms")]  # fmt: skip
        assert None not in stamps and stamps == sorted(stamps), tl
        assert tl["forward_ms"] > 0 and tl["prefill_steps"] == 1, tl
    hit = out["timelines"][1]
    assert (hit["hit_pool"], hit["loaded"]) == (4, 4) and hit["load_wait_ms"] > 0, hit
    assert out["timelines"][0]["load_wait_ms"] == 0.0


def test_pool_outlives_engine_and_async_load(
    pool, ray_cluster, tiny_model, baseline, tmp_path, connector
):
    """A new engine process (async loads this time) hits what the previous one saved."""
    out = run_engine(
        ray_cluster,
        tmp_path,
        "second",
        {
            "model": tiny_model,
            "connector": connector(load_async=True),
            "runs": [[P1]],
        },
    )
    assert out["runs"][0]["outputs"][0] == baseline["P1"]
    (line,) = request_counts(out["log"])
    assert line["hit_pool"] == 4 and line["loaded"] == 4 and line["failed"] == 0


def store_then_drop(ray_cluster, tmp_path, tiny_model, connector, connector_cfg):  # type: ignore[no-untyped-def]
    """Store P3's blocks with one engine, then run P3 on a fresh engine whose hit blocks are
    removed from the pool between its lookup and its load."""
    run_engine(
        ray_cluster, tmp_path, "store",
        {"model": tiny_model, "connector": connector(), "runs": [[P3]], "wait_saves_for": "e2e"},
    )  # fmt: skip
    spec = {"model": tiny_model, "connector": connector_cfg, "runs": [[P3]], "inject_drop": True,
            "wait_saves_for": "e2e"}  # fmt: skip
    return run_engine(ray_cluster, tmp_path, "dropped", spec)


@pytest.mark.parametrize("load_async", [False, True])
def test_failed_load_recomputes(
    pool, ray_cluster, tiny_model, baseline, tmp_path, load_async, connector
):
    cfg = {**connector(load_async=load_async), "policy": "recompute"}
    out = store_then_drop(ray_cluster, tmp_path, tiny_model, connector, cfg)
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_counts(out["log"])
    # Async: the failed request goes through lookup again (now a miss), is recomputed,
    # and stores the lost blocks again; sync: vLLM recomputes from the failed block.
    assert (line["hit_pool"], line["failed"], line["loaded"], line["saved"]) == (3, 3, 0, 3)


def test_failed_load_fails_request_under_fail_policy(
    pool, ray_cluster, tiny_model, tmp_path, connector
):
    cfg = {**connector(), "policy": "fail"}
    out = store_then_drop(ray_cluster, tmp_path, tiny_model, connector, cfg)
    assert out["runs"][0]["finish_reasons"] == ["error"]


def test_sigkilled_engine_leaves_no_region(
    pool, ray_cluster, tiny_model, baseline, tmp_path, connector, placement
):
    """An engine killed with SIGKILL (OOM killer, node drain) runs no exit handler: its
    region (the 1 GiB KV cache when shared, the staging region when staged) must still
    not outlive it, neither as a /dev/shm file nor as memory the rank's BackendClient
    actor keeps mapped. What it saved stays a hit."""
    proc = start_engine(
        ray_cluster,
        tmp_path,
        "killed",
        {
            "model": tiny_model,
            "connector": connector(load_async=False),
            "runs": [[P3]],
            "wait_saves_for": "e2e",
            "hang": True,
        },
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the actor has mapped the region: the engine saved
            if line.startswith("engine-run: hanging"):
                break
        else:
            pytest.fail(f"engine exited ({proc.wait()}):\n{proc.stderr.read()[-6000:]}")  # type: ignore[union-attr]
        prefix = "kvray-e2e-kv-" if placement == "shared" else "kvray-e2e-stage-"
        regions = [n for names in mapped_regions(prefix).values() for n in names]
        assert any(n.startswith(f"{prefix}{proc.pid}-") for n in regions), regions
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert_no_region_left("a SIGKILLed engine")
    out = run_engine(
        ray_cluster, tmp_path, "after-kill",
        {"model": tiny_model, "connector": connector(load_async=False), "runs": [[P3]]},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_counts(out["log"])
    assert line["hit_pool"] == 3 and line["loaded"] == 3 and line["failed"] == 0


def test_staged_loads_what_shared_stored(pool, ray_cluster, tiny_model, baseline, tmp_path):
    """One key layout for both placements: the bytes a staged engine gathers are the
    blocks a shared engine stored, so it loads them and generates the same tokens."""
    ns = {"model_namespace": "tiny-interop", "load_async": False}
    run_engine(ray_cluster, tmp_path, "as-shared", {
        "model": tiny_model, "connector": _connector(kv_placement="shared", **ns),
        "runs": [[P1]], "wait_saves_for": "e2e",
    })  # fmt: skip
    out = run_engine(ray_cluster, tmp_path, "as-staged", {
        "model": tiny_model, "connector": _connector(kv_placement="staged", **ns),
        "runs": [[P1]],
    })  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P1"]
    (line,) = request_counts(out["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 4, 0)


def test_hash_seed_mismatch_is_named_and_never_hits(
    pool, ray_cluster, tiny_model, baseline, tmp_path
):
    """Real engines with different PYTHONHASHSEEDs (vLLM's NONE_HASH seed) derive other
    block hashes for the same tokens: the second one gets no hit (never wrong bytes), and
    says why at attach (and so does ``kvray status``); the same seed hits."""
    spec = {"model": tiny_model, "runs": [[P1]],
            "connector": _connector(model_namespace="tiny-seeds", load_async=False)}  # fmt: skip
    a = run_engine(ray_cluster, tmp_path, "seed-1", {
        **spec, "env": {"PYTHONHASHSEED": "1"}, "wait_saves_for": "e2e"})  # fmt: skip
    same = run_engine(ray_cluster, tmp_path, "seed-1-again", {
        **spec, "env": {"PYTHONHASHSEED": "1"}})  # fmt: skip
    other = run_engine(ray_cluster, tmp_path, "seed-2", {
        **spec, "env": {"PYTHONHASHSEED": "2"}})  # fmt: skip
    for out in (a, same, other):
        assert out["runs"][0]["outputs"][0] == baseline["P1"]
    hits = [
        (ln["hit_pool"], ln["loaded"]) for o in (a, same, other) for ln in request_counts(o["log"])
    ]
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


def test_negative_control_corrupted_blocks_change_the_output(
    pool, ray_cluster, tiny_model, baseline, tmp_path
):
    """The oracle can see wrong bytes: blocks overwritten behind kvray's back (same keys,
    same sizes, other values) are loaded as hits and the engine's greedy output differs
    from the run without the connector. Every "outputs equal the baseline" assertion in
    these tests rests on this: with this model and prompt, wrong KV bytes show."""
    import numpy as np

    ns = "tiny-negative-control"
    spec = {"model": tiny_model, "connector": _connector(model_namespace=ns, load_async=False)}
    stored = run_engine(ray_cluster, tmp_path, "neg-store", {
        **spec, "runs": [[P1]], "wait_saves_for": "e2e", "record_hashes": True})  # fmt: skip
    assert stored["runs"][0]["outputs"][0] == baseline["P1"]
    hashes = [bytes.fromhex(h) for h in stored["block_hashes"][0][:4]]
    space = logged_key_space(stored["log"])
    assert (space.namespace, space.layout) == (ns, "float32-b128-h4x64")  # the tiny Llama's
    keys = space.lookup_key_strs(hashes)
    assert all(pool.exists(keys)), "the first run did not store P1's 4 blocks"
    block_bytes = 2 * 2 * 128 * 4 * 64 * 4  # K and V, 2 layers, float32
    rng = np.random.default_rng(0)
    for key in keys:
        real = pool.get(key, shape=(block_bytes // 4,), dtype=np.float32)
        assert real is not None
        wrong = rng.permutation(real) * np.float32(3.0)  # plausible values, wrong places
        pool.put(key, wrong.astype(np.float32), overwrite=True)
    loaded = run_engine(ray_cluster, tmp_path, "neg-load", {**spec, "runs": [[P1]]})
    (line,) = request_counts(loaded["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 4, 0), line
    assert loaded["runs"][0]["outputs"][0] != baseline["P1"], (
        "corrupted KV blocks gave the baseline's tokens: the output oracle cannot see "
        "wrong bytes with this model and prompt"
    )


def test_bytes_corrupted_inside_the_pool_fail_their_checksum_and_are_recomputed(
    pool, ray_cluster, tiny_model, baseline, tmp_path
):
    """The negative control's blocks, but changed inside the backend (one bit of each
    value, through a client without checksums, the trailer left as it was): the load
    verifies every block before vLLM may use it, so all four are reported failed and
    recomputed (the baseline's tokens, where the control above got other tokens), counted
    as corrupt, and removed from the pool; the recomputed blocks are stored again, and the
    next engine loads those."""
    import asyncio

    import numpy as np

    from kvray.backends import make_backend
    from kvray.backends.base import KeyStatus

    ns = "tiny-corrupt"
    spec = {"model": tiny_model, "connector": _connector(model_namespace=ns, load_async=False)}
    stored = run_engine(ray_cluster, tmp_path, "corrupt-store", {
        **spec, "runs": [[P1]], "wait_saves_for": "e2e", "record_hashes": True})  # fmt: skip
    hashes = [bytes.fromhex(h) for h in stored["block_hashes"][0][:4]]
    keys = logged_key_space(stored["log"]).lookup_key_strs(hashes)
    value = 2 * 2 * 128 * 4 * 64 * 4 + 8  # K and V, 2 layers, float32; and the trailer

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

    before = pool.stats().total.get_corrupt
    asyncio.run(flip_one_bit_each())
    loaded = run_engine(ray_cluster, tmp_path, "corrupt-load", {**spec, "runs": [[P1]]})
    assert loaded["runs"][0]["outputs"][0] == baseline["P1"]
    (line,) = request_counts(loaded["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 0, 4), line
    assert pool.stats().total.get_corrupt - before == 4
    assert pool.stats().total.misses()["corrupt"] >= 4
    # The bad values were removed and the recomputed blocks stored again: a third engine
    # loads all four, verified, and gets the baseline's tokens.
    again = run_engine(ray_cluster, tmp_path, "corrupt-again", {**spec, "runs": [[P1]]})
    assert again["runs"][0]["outputs"][0] == baseline["P1"]
    (line,) = request_counts(again["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 4, 0), line
    assert pool.stats().total.get_corrupt - before == 4


def _layerwise_keys(log: str, hashes: list[str], groups: int):  # type: ignore[no-untyped-def]
    """The engine's keys (its logged namespace, layout and geometries) with ``groups``
    layer groups per block."""
    space = logged_key_space(log, layer_groups=groups)
    return space.lookup_key_strs([bytes.fromhex(h) for h in hashes])


def test_layerwise_save_then_load(pool, ray_cluster, tiny_model, baseline, tmp_path, placement):
    """use_layerwise: each block is one key per layer group; the second run loads them
    group by group (waited for in wait_for_layer_load: had the forward not waited, the
    blocks would be reported failed, not loaded) and generates the baseline tokens. An
    engine without use_layerwise shares none of these keys."""
    lw = {"use_layerwise": True, "layerwise_groups": 2, "load_async": False}
    ns = {"kv_placement": placement, "model_namespace": f"tiny-lw-{placement}"}
    out = run_engine(ray_cluster, tmp_path, "layerwise", {
        "model": tiny_model, "connector": _connector(**ns, **lw), "runs": [[P1], [P1]],
        "wait_saves_for": "e2e", "record_hashes": True,
    })  # fmt: skip
    assert [r["outputs"][0] for r in out["runs"]] == [baseline["P1"]] * 2
    first, second = request_counts(out["log"])
    assert (first["hit_pool"], first["saved"]) == (0, 4)
    assert (second["hit_pool"], second["loaded"], second["failed"]) == (4, 4, 0)
    assert "layer-wise transfers, 2 layer groups of [1, 1] layers" in out["log"]
    hashes = out["block_hashes"][0][:4]
    assert logged_key_space(out["log"]).namespace == f"tiny-lw-{placement}"
    assert all(pool.exists(_layerwise_keys(out["log"], hashes, 2)))
    assert not any(pool.exists(_layerwise_keys(out["log"], hashes, 1)))
    if placement == "shared":
        return
    plain = run_engine(ray_cluster, tmp_path, "not-layerwise", {
        "model": tiny_model, "connector": _connector(**ns, load_async=False), "runs": [[P1]],
    })  # fmt: skip
    assert plain["runs"][0]["outputs"][0] == baseline["P1"]
    (line,) = request_counts(plain["log"])
    assert line["hit_pool"] == 0


def test_layerwise_without_layer_hooks_recomputes(
    pool, ray_cluster, tiny_model, baseline, tmp_path, placement
):
    """An engine that never calls wait_for_layer_load: the loaded bytes arrive after the
    forward read the cache, so the step's hits are reported failed and recomputed (same
    tokens), never used."""
    lw = {"use_layerwise": True, "layerwise_groups": 2, "load_async": False}
    ns = {"kv_placement": placement, "model_namespace": f"tiny-lw-{placement}"}
    out = run_engine(ray_cluster, tmp_path, "no-hooks", {
        "model": tiny_model, "connector": {**_connector(**ns, **lw), "policy": "recompute"},
        "runs": [[P1], [P1]], "skip_layer_hooks": True, "wait_saves_for": "e2e",
    })  # fmt: skip
    assert [r["outputs"][0] for r in out["runs"]] == [baseline["P1"]] * 2
    line = request_counts(out["log"])[-1]  # the first run stored P1 if it was not there
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 0, 4)
    assert "without calling wait_for_layer_load" in out["log"]
