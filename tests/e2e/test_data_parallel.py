"""Data parallel on one pool: a real vLLM OpenAI server with ``--data-parallel-size 2``
(two engine cores, each with its own worker and KVRayConnector) over a real kvray pool:
blocks stored by one DP rank are hits for the other."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import prompts, start_pool
from .test_pd_proxy import STARTUP_S, Server

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


def _post(url: str, body: dict, dp_rank: int) -> dict:
    """A completion routed to DP rank ``dp_rank`` (vLLM's ``X-data-parallel-rank``)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-data-parallel-rank": str(dp_rank)},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def _by_engine(log: str) -> dict[str, list[dict[str, int]]]:
    """Per EngineCore pid (one per DP rank), its per-request connector lines."""
    out: dict[str, list[dict[str, int]]] = {}
    for pid, line in re.findall(
        r"\((?:EngineCore\S*) pid=(\d+)\).*request_id=\S+ (total_blocks=.*)", log
    ):
        out.setdefault(pid, []).append(
            {k: int(v) for k, v in (kv.split("=") for kv in line.split())}
        )
    return out


def test_two_dp_ranks_share_the_pool(ray_cluster, tiny_model, tmp_path):
    from kvray.servers.process import free_port

    pool = start_pool("dp", 2, "256MB")
    port = free_port()
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
    }
    transfer = (
        '{"kv_connector": "KVRayConnector", "kv_connector_module_path": "kvray.connector",'
        ' "kv_role": "kv_both", "kv_load_failure_policy": "recompute",'
        ' "kv_connector_extra_config": {"pool_name": "dp", "load_async": false,'
        ' "lookup_timeout_ms": 5000}}'
    )
    # lookup_timeout_ms: on a shared 2-core machine two engine cores busy-polling can delay
    # a lookup past the 200 ms default, which is then (correctly) a miss; this test is
    # about which blocks the other rank can load, not about lookup latency.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "4096", "--no-enable-prefix-caching", "--seed", "0",
           "--data-parallel-size", "2", "--kv-transfer-config", transfer]  # fmt: skip
    server = Server("dp", cmd, env, tmp_path / "dp.log")
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}/health", time.monotonic() + STARTUP_S)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": tiny_model, "max_tokens": 4, "temperature": 0.0,
                "return_token_ids": True}  # fmt: skip
        # Prompt i goes to DP rank i % 2, which stores it; then to the other rank, which
        # must load it from the pool (prefix caching is off: nothing else could serve it)
        # and generate the same tokens.
        ps = [prompts(20 + i, 3 * 128 + 5) for i in range(4)]
        first = [_post(url, {**body, "prompt": p}, i % 2) for i, p in enumerate(ps)]
        again = [_post(url, {**body, "prompt": p}, (i + 1) % 2) for i, p in enumerate(ps)]
        for a, b in zip(first, again, strict=True):
            assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        deadline = time.monotonic() + 20
        while True:
            engines = _by_engine(server.tail(10**8))
            if sum(len(v) for v in engines.values()) >= 8:
                break
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.2)
        status = pool.stats()
        log = server.tail(10**8)
    finally:
        server.stop()
        pool.shutdown()
    assert len(engines) == 2, f"requests reached {len(engines)} engine core(s): {engines}"
    for lines in engines.values():  # each DP rank: 2 stored, 2 loaded what the other stored
        assert [(x["saved"], x["hit_pool"], x["loaded"]) for x in lines] == [(3, 0, 0)] * 2 + [
            (0, 3, 3)
        ] * 2, (engines, [ln for ln in log.splitlines() if "WARNING" in ln or "ERROR" in ln])
    # A worker uses the client of its local rank (vLLM's device index: distinct cards of
    # a node have distinct clients). vLLM's CPU workers of both DP ranks are local rank
    # 0, so here both engines' KV regions are mapped by slot 0's client.
    slot0 = status.ranks[0].stats
    assert (slot0.put_keys, slot0.get_keys, slot0.regions) == (12, 12, 2), status.table()
