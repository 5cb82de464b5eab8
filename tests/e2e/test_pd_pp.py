"""A decode instance without PP stores for a 2-stage pipeline-parallel prefill instance
(``prefill_pp_size: 2``, ``prefill_pp_layer_partition: "1,1"``): each block is split by
the prefill's layer partition and keyed with the prefill stage's PP rank. The real PP=2
prefill engine (vLLM's multiprocessing executor, one worker process per stage) then finds
and loads its part in every stage, and its output equals the run without any connector."""

from __future__ import annotations

import pytest

from .conftest import P3, request_lines, run_engine, start_pool

pytestmark = pytest.mark.e2e

# vLLM binds each CPU worker's threads; with one NUMA node the binding must be given.
PP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def pool_pp(ray_cluster):
    p = start_pool("e2e-pp", 2, "128MB")  # TP 1 x prefill PP 2 ranks
    yield p
    p.shutdown()


def test_decode_stores_for_pp2_prefill_which_loads_each_stage(
    pool_pp, ray_cluster, tiny_model, baseline, tmp_path
):
    extra = {"pool_name": "e2e-pp", "namespace": "kvray"}
    decode = {"extra": {**extra, "consumer_is_to_put": True, "prefill_pp_size": 2,
                        "prefill_pp_layer_partition": "1,1"}, "role": "kv_consumer"}  # fmt: skip
    out = run_engine(
        ray_cluster, tmp_path, "decode-split",
        {"model": tiny_model, "connector": decode, "runs": [[P3]], "wait_saves_for": "e2e-pp"},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_lines(out["log"])
    assert (line["hit_pool"], line["saved"]) == (0, 3), line
    assert "blocks split by prefill PP partition [1, 1]" in out["log"]
    # one key per block and stage, each stage's under its own PP rank
    stats = pool_pp.stats()
    assert sum(r.stats.put_keys for r in stats.ranks) == 6

    prefill = {"extra": extra, "role": "kv_producer"}
    out = run_engine(
        ray_cluster, tmp_path, "prefill-pp2",
        {"model": tiny_model, "connector": prefill, "pp": 2, "env": PP_ENV, "runs": [[P3]]},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_lines(out["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (3, 3, 0), line
    # each prefill stage's worker loaded its layers through its own rank
    assert [r.stats.get_keys for r in pool_pp.stats().ranks] == [3, 3]
