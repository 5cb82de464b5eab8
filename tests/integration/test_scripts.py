"""The scripts that need Ray or a backend server but no vLLM engine, each run in its smoke
mode (``--smoke``: the full run with small arguments) as a user runs it: it exits 0,
prints its table, and writes JSON with the full run's keys (``tests/script_smoke.py``).

Each script starts what it needs itself (its own local Ray cluster, pools, servers) and
stops it; ``pool_job.py`` joins the session's cluster, as a Ray job joins its cluster.
"""

from __future__ import annotations

import json
import time

import psutil
import pytest

from tests.script_smoke import committed_keys, json_keys, run_script

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("script", "result", "table"),
    [
        ("bench_store.py", "bench_store.json", "put GB/s"),
        ("bench_ssd.py", "bench_ssd.json", "write GB/s"),
        ("bench_channel.py", "bench_channel.json", "channel p50"),
    ],
)
def test_benchmark_smoke(tmp_path, script, result, table):
    """A store benchmark's smoke run: its JSON has the keys of the committed full run."""
    out = tmp_path / result
    res = run_script(script, "--json", str(out), timeout_s=280)
    assert table in res.stdout
    assert json_keys(out) == committed_keys(result)


DEMO_POOL_KEYS = {
    "by_key", "by_key.byte_exact", "by_key.missing_key_is_none",
    "zero_copy", "zero_copy.blocks", "zero_copy.put_s", "zero_copy.byte_exact",
    "lookup", "lookup.stored", "lookup.blocks", "lookup.hit",
    "async", "async.value", "async.lookup_hit",
    "pool", "pool.puts", "pool.gets",
}  # fmt: skip
"""What scripts/demo_pool.py records, step by step."""


@pytest.mark.timeout(240)
def test_demo_pool_smoke(tmp_path):
    out = tmp_path / "demo_pool.json"
    res = run_script("demo_pool.py", "--json", str(out), timeout_s=220)
    assert "hit rate" in res.stdout  # the pool's status table
    assert json_keys(out) == DEMO_POOL_KEYS
    got = json.loads(out.read_text())
    assert got["by_key"] == {"byte_exact": True, "missing_key_is_none": True}
    assert got["zero_copy"]["byte_exact"] and got["zero_copy"]["blocks"] == 8
    # prompt B shares 8 of its 11 blocks with A, which both TP ranks stored
    assert got["lookup"] == {"stored": 13, "blocks": 11, "hit": 8}
    assert got["async"] == {"value": list(range(10)), "lookup_hit": 13}


POOL_JOB_KEYS = {"requests", "seconds", "hit_blocks", "total_blocks", "hit_rate"}


@pytest.mark.timeout(180)
def test_pool_job_smoke(tmp_path, ray_cluster):
    """pool_job.py joins the cluster of RAY_ADDRESS (here the session's), starts its
    pool and stops it: 2 requests of 4 blocks, the second hitting the shared half."""
    out = tmp_path / "pool_job.json"
    res = run_script(
        "pool_job.py", "--name", "smokejob", "--namespace", "kvray-test", "--start", "--down",
        "--json", str(out), env={"RAY_ADDRESS": ray_cluster}, timeout_s=160,
    )  # fmt: skip
    assert "hit rate" in res.stdout and "pool 'smokejob' stopped" in res.stdout
    assert json_keys(out) == POOL_JOB_KEYS
    got = json.loads(out.read_text())
    assert (got["requests"], got["hit_blocks"], got["total_blocks"]) == (2, 2, 8)


CLUSTER_KEYS = {
    "host", "etcd", "etcd.pid", "etcd.address", "etcd_address",
    "workers", "workers[].pid", "workers[].address", "workers[].dir", "workers[].uds_dir",
}  # fmt: skip
"""``up``'s ``cluster.json`` (what ``down`` reads)."""


@pytest.mark.timeout(240)
def test_datasystem_cluster_smoke(tmp_path):
    """``up --smoke`` (etcd and one worker of 128 MB) and ``down``: cluster.json has
    ``up``'s keys and every process it names is gone after ``down``."""
    home = tmp_path / "cluster"
    pids: list[int] = []
    try:
        res = run_script("datasystem_cluster.py", "up", "--dir", str(home), timeout_s=150)
        assert res.stdout.count("export DS_WORKER_ADDR=") == 1
        cluster = json.loads((home / "cluster.json").read_text())
        pids = [cluster["etcd"]["pid"]] + [w["pid"] for w in cluster["workers"]]
        assert json_keys(home / "cluster.json") == CLUSTER_KEYS
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        if (home / "cluster.json").exists():
            run_script("datasystem_cluster.py", "down", "--dir", str(home), smoke=False)
    assert not home.exists()
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(p) for p in pids)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
