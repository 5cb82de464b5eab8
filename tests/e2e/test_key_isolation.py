"""Engines never load KV that is not theirs, on real vLLM engines:

- another block geometry under the same namespace (a 3-layer model forced into the
  2-layer model's ``model_namespace``: same layout tag, other bytes) gets no hit after
  the pool restarted with its SSD tier, with the embedded master and with an external one
  that outlives the pool, while the engine that stored the blocks still hits;
- another checkpoint (same architecture and tokenizer, other weights) at a path with the
  same last part gets no hit by default, and a byte-identical copy elsewhere does.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from kvray.connector.log_lines import request_counts

from .conftest import P1, run_engine

pytestmark = pytest.mark.e2e


def _ssd_pool(name: str, ssd: Path, master: str | None):  # type: ignore[no-untyped-def]
    from kvray import Pool, PoolConfig

    data: dict = {
        "name": name,
        "world_size": 1,
        "detached": False,
        "pipeline": "mooncake|ssd",
        "ssd": {"path": str(ssd), "quota": "256MB", "io_threads": 2},
        "mooncake": {"global_segment_size": "64MB", "local_buffer_size": "32MB"},
    }
    if master is not None:
        data["mooncake"]["master_server_address"] = master
    return Pool.start(PoolConfig.from_dict(data, environ={}))


def _one_run(cluster: str, tmp: Path, name: str, model: str, extra: dict | None) -> dict:
    spec: dict = {"model": model, "runs": [[P1]], "connector": None}
    if extra is not None:
        spec["connector"] = {"extra": {"namespace": "kvray", **extra}}
        spec["wait_saves_for"] = extra["pool_name"]
    out = run_engine(cluster, tmp, name, spec)
    out["tokens"] = out["runs"][0]["outputs"][0]
    out["lines"] = request_counts(out["log"])
    return out


@pytest.fixture(scope="module")
def three_layer_model(tmp_path_factory):
    from kvray.testing.tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("model3") / "tiny-llama", num_layers=3))


@pytest.fixture(scope="module")
def three_layer_tokens(ray_cluster, three_layer_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("base3")
    return _one_run(ray_cluster, tmp, "base3", three_layer_model, None)["tokens"]


@pytest.fixture(params=["embedded master", "external master"])
def master(request):  # type: ignore[no-untyped-def]
    """None (the pool runs its own master) or the address of a master the test runs,
    which outlives the pool's restart."""
    if request.param == "embedded master":
        yield None
        return
    from kvray.config import MooncakeMasterConfig
    from kvray.servers.mooncake_master import MooncakeMaster

    with tempfile.TemporaryDirectory(prefix="kvray-test-master-") as log_dir:
        server = MooncakeMaster(MooncakeMasterConfig(client_ttl_s=2), log_dir)
        server.start()
        yield server.address
        server.stop()


@pytest.mark.timeout(900)
def test_another_geometry_never_loads_after_a_pool_restart(
    ray_cluster, tiny_model, baseline, three_layer_model, three_layer_tokens, master, tmp_path
):
    name = f"iso{int(time.monotonic() * 1000) % 100000}"
    extra = {"pool_name": name, "model_namespace": "iso-shared"}
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    pool = _ssd_pool(name, ssd, master)
    try:
        first = _one_run(ray_cluster, tmp_path, "store", tiny_model, extra)
        assert first["tokens"] == baseline["P1"]
        assert first["lines"][0]["saved"] == 4, first["lines"]
        deadline = time.monotonic() + 30
        while pool.stats().total.ssd_blocks < 4:
            assert time.monotonic() < deadline, "the SSD tier never held the 4 blocks"
            time.sleep(0.2)
    finally:
        pool.shutdown()
    # A new pool: DRAM starts empty (or, with the external master, its old entries die
    # with the old clients), the SSD tier still has the 4 blocks; nothing else remembers.
    pool = _ssd_pool(name, ssd, master)
    try:
        other = _one_run(ray_cluster, tmp_path, "other", three_layer_model, extra)
        assert other["lines"][0]["hit_pool"] == 0, other["lines"]
        assert other["lines"][0]["failed"] == 0
        assert other["tokens"] == three_layer_tokens
        again = _one_run(ray_cluster, tmp_path, "again", tiny_model, extra)
        line = again["lines"][0]
        assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 4, 0), again["lines"]
        assert again["tokens"] == baseline["P1"]
    finally:
        pool.shutdown()


@pytest.mark.timeout(900)
def test_another_checkpoint_never_shares_keys_by_default(
    pool, ray_cluster, tiny_model, baseline, tmp_path
):
    from kvray.testing.tiny_model import build_tiny_llama

    other = str(build_tiny_llama(tmp_path / "other" / "tiny-llama", seed=1))
    copy = tmp_path / "copy" / "tiny-llama"
    shutil.copytree(tiny_model, copy)
    assert Path(other).name == Path(tiny_model).name == copy.name
    extra = {"pool_name": "e2e"}  # no model_namespace: the default, with the model digest
    other_tokens = _one_run(ray_cluster, tmp_path, "other-base", other, None)["tokens"]
    assert other_tokens != baseline["P1"], "the two checkpoints must differ in their output"

    first = _one_run(ray_cluster, tmp_path, "first", tiny_model, extra)
    assert first["tokens"] == baseline["P1"] and first["lines"][0]["saved"] == 4
    other_run = _one_run(ray_cluster, tmp_path, "other", other, extra)
    assert other_run["lines"][0]["hit_pool"] == 0, other_run["lines"]
    assert other_run["tokens"] == other_tokens
    # A byte-identical copy at another path shares the first one's keys.
    copied = _one_run(ray_cluster, tmp_path, "copy", str(copy), extra)
    line = copied["lines"][0]
    assert (line["hit_pool"], line["loaded"], line["failed"]) == (4, 4, 0), copied["lines"]
    assert copied["tokens"] == baseline["P1"]
    assert "key namespace tiny-llama-m" in first["log"]
