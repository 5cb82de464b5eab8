"""KVRayConnector on a real vLLM engine over a yuanrong pool (its own embedded datasystem
worker): what the engine saves is loaded back byte-exact (greedy outputs equal the run
without a connector) and only shared prefixes load, as on Mooncake."""

from __future__ import annotations

import pytest

from kvray.connector.log_lines import request_counts

from .conftest import P1, P2, connector, run_engine, start_pool

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def yr_pool(ray_cluster):
    p = start_pool("e2e-yr", 1, "256MB", backend="yuanrong")
    yield p
    p.shutdown()


def test_save_then_load_on_yuanrong(yr_pool, ray_cluster, tiny_model, baseline, tmp_path):
    out = run_engine(
        ray_cluster,
        tmp_path,
        "yr",
        {
            "model": tiny_model,
            "connector": connector("e2e-yr", backend="yuanrong"),
            "runs": [[P1], [P1], [P2]],
            "wait_saves_for": "e2e-yr",
        },
    )
    runs = out["runs"]
    assert [r["outputs"][0] for r in runs] == [baseline["P1"], baseline["P1"], baseline["P2"]]
    lines = request_counts(out["log"])
    assert [(x["hit_pool"], x["loaded"], x["saved"], x["failed"]) for x in lines] == [
        (0, 0, 4, 0),
        (4, 4, 0, 0),
        (2, 2, 1, 0),
    ]
    stats = yr_pool.stats()
    assert stats.backend == "yuanrong" and stats.total.get_keys >= 6


def test_connector_backend_must_match_the_pool(yr_pool, ray_cluster, tiny_model, tmp_path):
    with pytest.raises(AssertionError, match="runs 'yuanrong'"):
        run_engine(
            ray_cluster,
            tmp_path,
            "mismatch",
            {"model": tiny_model, "connector": connector("e2e-yr"), "runs": [[P1]]},
        )
