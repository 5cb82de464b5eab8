"""TP=2 under vLLM's multiprocessing executor: each worker process joins the Ray
ray_cluster, stores its own half of the heads under its rank's keys, and a block counts as
a hit only when both ranks have it."""

from __future__ import annotations

import pytest

from kvray.connector.log_lines import request_counts

from .conftest import BLOCK, prompts, run_engine, start_pool

# TP 2 engines (two workers each) start in minutes on a loaded 2-core host.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pool2(ray_cluster):
    p = start_pool("e2e-tp", 2, "128MB")
    yield p
    p.shutdown()


# vLLM binds each CPU worker's threads; with one NUMA node the binding must be given.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPT = prompts(11, 3 * BLOCK + 20)


@pytest.fixture(scope="module")
def tp_baseline(ray_cluster, tiny_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    """TP=2 greedy tokens of PROMPT without a connector."""
    out = run_engine(
        ray_cluster, tmp_path_factory.mktemp("tp-base"), "tp-base",
        {"model": tiny_model, "connector": None, "tp": 2, "env": TP_ENV, "runs": [[PROMPT]]},
    )  # fmt: skip
    return out["runs"][0]["outputs"][0]


def test_tp2_ranks_store_and_load_their_halves(
    pool2, ray_cluster, tiny_model, tp_baseline, tmp_path
):
    conn = {"extra": {"pool_name": "e2e-tp", "namespace": "kvray"}}
    out = run_engine(
        ray_cluster, tmp_path, "tp",
        {"model": tiny_model, "connector": conn, "tp": 2, "env": TP_ENV,
         "runs": [[PROMPT], [PROMPT]], "wait_saves_for": "e2e-tp"},
    )  # fmt: skip
    assert [r["outputs"][0] for r in out["runs"]] == [tp_baseline] * 2
    first, second = request_counts(out["log"])[:2]
    assert (first["hit_pool"], first["saved"]) == (0, 3), first
    assert (second["hit_pool"], second["loaded"]) == (3, 3), second
    # Each rank stored and loaded its own half of the heads, under its own keys.
    ranks = pool2.stats().ranks
    assert [r.stats.put_keys for r in ranks] == [3, 3]
    assert [r.stats.get_keys for r in ranks] == [3, 3]


def test_tp2_staged_loads_what_tp2_shared_stored(
    pool2, ray_cluster, tiny_model, tp_baseline, tmp_path
):
    """The staged placement with two workers: each rank gathers its half of the heads
    into its own staging region and loads (into its KV cache) the half its rank stored
    through the shared placement in the test above: same keys, same bytes, same tokens."""
    conn = {"extra": {"pool_name": "e2e-tp", "namespace": "kvray", "kv_placement": "staged"}}
    out = run_engine(
        ray_cluster, tmp_path, "tp-staged",
        {"model": tiny_model, "connector": conn, "tp": 2, "env": TP_ENV, "runs": [[PROMPT]]},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == tp_baseline
    (line,) = request_counts(out["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (3, 3, 0), line
    assert out["log"].count("staged placement") == 2, "both workers use staging"
    ranks = pool2.stats().ranks
    assert [r.stats.get_keys for r in ranks] == [6, 6]


def test_tp2_hybrid_model_ranks_store_and_load_every_group(
    pool2, ray_cluster, tiny_gemma3, tmp_path
):
    """The tiny Gemma 3 (three sliding-window groups, one full) at TP 2: each rank keys its
    half of every group's heads apart, saves every block of every group, and loads the full
    group's blocks and each sliding group's window block; same tokens as TP 2 without a
    connector."""
    runs = {"model": tiny_gemma3, "tp": 2, "env": TP_ENV, "runs": [[PROMPT], [PROMPT]]}
    base = run_engine(ray_cluster, tmp_path, "tp-hybrid-base", {**runs, "connector": None})
    want = base["runs"][0]["outputs"][0]
    before = [r.stats for r in pool2.stats().ranks]
    conn = {"extra": {"pool_name": "e2e-tp", "namespace": "kvray"}}
    out = run_engine(
        ray_cluster, tmp_path, "tp-hybrid",
        {**runs, "connector": conn, "wait_saves_for": "e2e-tp"},
    )  # fmt: skip
    assert [r["outputs"][0] for r in out["runs"]] == [want] * 2
    first, second = request_counts(out["log"])[:2]
    assert (first["hit_pool"], first["saved"]) == (0, 3), first
    assert (second["hit_pool"], second["loaded"], second["failed"]) == (3, 3, 0), second
    after = [r.stats for r in pool2.stats().ranks]
    # Per rank: 3 blocks x 4 groups stored; loaded: the full group's 3 blocks and, of each
    # sliding group, the one block inside its 64-token window before the hit's end.
    assert [a.put_keys - b.put_keys for a, b in zip(after, before, strict=True)] == [12, 12]
    assert [a.get_keys - b.get_keys for a, b in zip(after, before, strict=True)] == [6, 6]
