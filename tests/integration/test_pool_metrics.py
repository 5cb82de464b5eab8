"""The pool's counters through Ray's metrics (what Prometheus scrapes from Ray's metrics
agent), and ``kvray status --watch``, against a running pool with an embedded master."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from kvray.keys import KeySpace, KVLayout, chain_block_hashes

from .conftest import small_config

pytestmark = pytest.mark.integration


def scrape(port: int, name: str, **labels: str) -> float | None:
    """Sum of ``name``'s samples with ``labels`` on Ray's metrics endpoint (None: none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(w in line for w in want)
    ]
    return sum(values) if values else None


@pytest.fixture(scope="module")
def pool(ray_cluster):
    from kvray import Pool

    p = Pool.start(small_config(None))  # embedded mooncake_master
    yield p
    p.shutdown()


def test_pool_counters_reach_rays_metrics_endpoint(pool, ray_cluster):
    import ray

    (node,) = ray.nodes()
    port = int(node["MetricsExportPort"])
    name = pool.config.name
    space = KeySpace(f"{name}-m", KVLayout("float16", 16, 2, 64).tag())
    hashes = chain_block_hashes(list(range(96)), 16)  # 6 blocks
    block = np.ones(256 << 10, np.uint8)
    assert pool.lookup_why(space, hashes) == (0, "not_stored")
    pool.put([space.key(h) for h in hashes[:4]], [block] * 4)
    got = pool.get([space.key(h) for h in hashes[:4]], out=[np.empty_like(block) for _ in range(4)])
    assert all(g is not None for g in got)

    want = {
        ("ray_kvray_put_blocks_total", ()): 4,
        ("ray_kvray_put_bytes_total", ()): 4 * (256 << 10),
        ("ray_kvray_get_blocks_total", ()): 4,
        ("ray_kvray_lookup_blocks_total", ()): 6,
        ("ray_kvray_missed_blocks_total", (("reason", "not_stored"),)): 6,
        ("ray_kvray_segment_bytes", ()): 2 * (64 << 20),  # two clients' segments
        ("ray_kvray_pool_capacity_bytes", ()): 2 * (64 << 20),  # as the master sees it
    }
    # The master's gauges (used bytes, keys) come from its own metrics, polled apart from
    # the counters: each is waited for, not read once after the counters arrived.
    deadline = time.monotonic() + 90  # Ray reports every 10 s, kvray exports every 5 s
    while True:
        seen = {key: scrape(port, key[0], pool=name, **dict(key[1])) for key in want}
        used = scrape(port, "ray_kvray_pool_used_bytes", pool=name)
        keys = scrape(port, "ray_kvray_pool_keys", pool=name)
        master = used is not None and used >= 4 * (256 << 10) and keys == 4
        if (seen == want and master) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert seen == want
    assert used is not None and used >= 4 * (256 << 10), used
    assert keys == 4, keys

    # kvray status shows the master's view and the misses by reason
    table = pool.stats().table()
    assert "memory (master):" in table and "4 keys" in table, table
    assert "missed blocks by reason: not stored 6" in table, table


def test_status_watch_refreshes_with_rates(pool, ray_cluster):
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    args = ["--address", ray_cluster, "--namespace", pool.config.namespace]
    res = subprocess.run(
        [sys.executable, "-m", "kvray.cli", *args, "--name", pool.config.name,
         "status", "--watch", "0.5", "--count", "3"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.count(f"kvray pool {pool.config.name!r}") == 3, out
    assert "rates from the next refresh on" in out
    assert len(re.findall(r"put \d+\.\d{3} GB/s \(\d+ blocks/s\)", out)) == 2, out
    bad = subprocess.run(
        [sys.executable, "-m", "kvray.cli", *args, "--name", pool.config.name,
         "status", "--watch", "0"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--watch takes seconds > 0" in bad.stderr
