"""A decode instance without PP storing for a 2-stage pipeline-parallel prefill instance
(``prefill_pp_size: 2``, ``prefill_pp_layer_partition: "1,1"``) on a real vLLM engine:
each block becomes one key per prefill stage, under that stage's PP rank, holding that
stage's layers: the keys each prefill stage's worker looks up and loads. A second such
decode engine loads the blocks back from both stages' keys with output equal to the
run without any connector.

A real PP prefill engine cannot run here: vLLM 0.32's CPU platform fails pipeline
parallelism with no connector at all (``assert self.intermediate_tensors is not None``
in the second stage's worker), and kvray's connector supports CPU KV caches only. So the
stage side is checked through the pool: the exact keys a stage worker of TP rank 0 would
use, with the byte size of that stage's layers."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.connector.log_lines import request_counts

from .conftest import P3, logged_key_space, run_engine, start_pool

pytestmark = pytest.mark.e2e

BLOCK_LAYER_BYTES = 128 * 4 * 64 * 2 * 4  # tokens x kv heads x head size x (K, V) x fp32


@pytest.fixture(scope="module")
def pool_pp(ray_cluster):
    p = start_pool("e2e-pp", 2, "128MB")  # TP 1 x prefill PP 2 ranks
    yield p
    p.shutdown()


def test_decode_stores_split_by_prefill_pp_stage_and_loads_it_back(
    pool_pp, ray_cluster, tiny_model, baseline, tmp_path
):
    from pathlib import Path

    from kvray.keys import KeySpace, geometry_digest

    decode = {"extra": {"pool_name": "e2e-pp", "namespace": "kvray", "consumer_is_to_put": True,
                        "consumer_is_to_load": True, "prefill_pp_size": 2,
                        "prefill_pp_layer_partition": "1,1"},
              "role": "kv_consumer"}  # fmt: skip
    out = run_engine(
        ray_cluster, tmp_path, "decode-split",
        {"model": tiny_model, "connector": decode, "runs": [[P3]], "wait_saves_for": "e2e-pp",
         "record_hashes": True},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_counts(out["log"])
    assert (line["hit_pool"], line["saved"]) == (0, 3), line
    assert "blocks split by prefill PP partition [1, 1]" in out["log"]

    # What each stage of the PP=2 prefill instance (TP 1) looks up: its PP rank's keys,
    # each holding its one layer of the block. Their geometry is what a stage worker's
    # own KV cache gives (vLLM's CPU layout, one plane of 4 heads x 128 tokens x K|V of
    # 64: p4x128x128; the stage's one layer), and the decode must have keyed them so.
    (hashes,) = out["block_hashes"]
    full = [bytes.fromhex(h) for h in hashes[:3]]
    logged = logged_key_space(out["log"], pp_size=2)
    namespace, layout = logged.namespace, logged.layout
    assert namespace.startswith(f"{Path(tiny_model).name}-m") and layout == "float32-b128-h4x64"
    stage_geometries = tuple(
        geometry_digest("p4x128x128", [f"model.layers.{i}.self_attn.attn"]) for i in (0, 1)
    )
    assert logged.geometries == stage_geometries
    prefill = KeySpace(namespace, layout, 1, 2, geometries=stage_geometries)
    stages = []
    for stage in (0, 1):
        keys = prefill.rank_key_strs(full, stage)  # rank = pp_rank * tp + tp_rank
        assert all(pool_pp.exists(keys)), f"stage {stage}: its keys are not in the pool"
        got = pool_pp.get(keys, shape=(BLOCK_LAYER_BYTES,), dtype=np.uint8)
        assert all(g is not None for g in got), f"stage {stage}: not one layer per key"
        stages.append(np.stack(got))
    assert not np.array_equal(stages[0], stages[1]), "both stages hold the same layer"

    # A fresh decode engine reassembles every block from both stages' keys.
    out = run_engine(
        ray_cluster, tmp_path, "decode-split-load",
        {"model": tiny_model, "connector": decode, "runs": [[P3]]},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_counts(out["log"])
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (3, 3, 0), line
