"""Data parallel on one pool: a real vLLM OpenAI server with ``--data-parallel-size 2``
(two engine cores, each with its own worker and KVRayConnector) over a real kvray pool
with kvray's SSD tier (``mooncake|ssd``): blocks stored by one DP rank are hits for the
other, and, once only the SSD tier holds them, each DP rank's lookup asks the SSD tier
of the slot its own worker loads through."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvray.connector.log_lines import request_lines
from kvray.testing.server import Server
from tests.conftest import LOOKUP_TIMEOUT_MS

from .conftest import STARTUP_S, prompts, remove_behind_the_index

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


def _ssd_slots(log: str) -> dict[str, tuple[str, int]]:
    """Per EngineCore pid, the (node, slot) its scheduler's SSD lookups ask for rank 0
    (what its worker told it in vLLM's handshake)."""
    found = re.findall(
        r"\((?:EngineCore\S*) pid=(\d+)\).*SSD lookups ask, per rank, rank 0: slot (\d+) "
        r"of node (\w+)",
        log,
    )
    return {pid: (node, int(slot)) for pid, slot, node in found}


def _by_engine(log: str) -> dict[str, list[dict[str, int]]]:
    """Per EngineCore pid (one per DP rank), its per-request connector lines."""
    out: dict[str, list[dict[str, int]]] = {}
    for line in request_lines(log):
        if line.engine_pid is not None:
            out.setdefault(line.engine_pid, []).append(line.counts)
    return out


@pytest.mark.timeout(900)  # two engine cores start in minutes on a loaded 2-core host
def test_two_dp_ranks_share_the_pool(ray_cluster, tiny_model, tmp_path):
    import ray

    from kvray import Pool, PoolConfig
    from kvray.servers.process import free_port

    (tmp_path / "ssd").mkdir()
    pool = Pool.start(
        PoolConfig.from_dict(
            {
                "name": "dp",
                "world_size": 2,
                "detached": False,
                "pipeline": "mooncake|ssd",
                "ssd": {"path": str(tmp_path / "ssd"), "quota": "256MB", "io_threads": 2},
                "mooncake": {"global_segment_size": "256MB", "local_buffer_size": "32MB"},
                # The Lookup actor's lookups: which SSD tier each rank's lookup asks is
                # what this test checks (the node index's SSD slot bits are tested in
                # tests/integration/test_block_index.py). With the index, the DRAM blocks
                # dropped behind kvray's back would still read as DRAM hits, served from
                # SSD at load.
                "lookup_index": False,
            },
            environ={},
        )
    )
    node = ray.get_runtime_context().get_node_id()
    port = free_port()
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster,
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    transfer = json.dumps({
        "kv_connector": "KVRayConnector", "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool_name": "dp", "load_async": False,
                                      "lookup_timeout_ms": LOOKUP_TIMEOUT_MS},
    })  # fmt: skip
    # lookup_timeout_ms: on a shared 2-core machine two engine cores busy-polling can delay
    # a lookup past the 200 ms default, which is then (correctly) a miss; this test is
    # about which blocks the other rank can load, not about lookup latency.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "4096", "--no-enable-prefix-caching", "--seed", "0",
           "--data-parallel-size", "2", "--kv-transfer-config", transfer]  # fmt: skip
    server = Server("dp", cmd, env, tmp_path / "dp.log", port=port)

    def lines(n: int) -> dict[str, list[dict[str, int]]]:
        """Each engine core's request lines, once ``n`` were logged in all."""
        deadline = time.monotonic() + 20
        while True:
            engines = _by_engine(server.tail(10**8))
            if sum(len(v) for v in engines.values()) >= n:
                return engines
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.2)

    def stored(n: int) -> None:
        """Wait until both tiers hold ``n`` blocks."""
        deadline = time.monotonic() + 30
        while True:
            total = pool.stats().total
            if total.put_keys >= n and total.ssd_put_keys >= n:
                return
            assert time.monotonic() < deadline, pool.stats().table()
            time.sleep(0.2)

    try:
        server.wait_healthy(time.monotonic() + STARTUP_S)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": tiny_model, "max_tokens": 4, "temperature": 0.0,
                "return_token_ids": True}  # fmt: skip
        # Prompt i goes to DP rank i % 2, which stores it; then to the other rank, which
        # must load it from the pool (prefix caching is off: nothing else could serve it)
        # and generate the same tokens.
        ps = [prompts(20 + i, 3 * 128 + 5) for i in range(4)]
        first = [_post(url, {**body, "prompt": p}, i % 2) for i, p in enumerate(ps)]
        # A response can return before its blocks' save ends (vLLM frees them after).
        # The next round's lookups would then find the SSD copy while the DRAM put still
        # runs, and load from SSD: correct bytes, but not the DRAM loads counted below.
        stored(12)
        again = [_post(url, {**body, "prompt": p}, (i + 1) % 2) for i, p in enumerate(ps)]
        for a, b in zip(first, again, strict=True):
            assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        lines(8)
        # Only the SSD tier holds the blocks now: each rank's lookup must ask the SSD tier
        # of the slot its own worker loads through, and that worker load them from it.
        assert pool.stats().total.ssd_put_keys == 12  # 4 prompts x 3 blocks, stored once
        assert remove_behind_the_index(pool.server_address) >= 12
        ssd = [_post(url, {**body, "prompt": p}, i % 2) for i, p in enumerate(ps)]
        for a, b in zip(first, ssd, strict=True):
            assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        engines = lines(12)
        # (each scheduler reports its lookups' counters to the pool just after a request)
        deadline = time.monotonic() + 10
        while (status := pool.stats()).total.lookup_ssd_blocks < 12:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        lookup = pool._h.lookup().snapshot().result(30)  # noqa: SLF001
        log = server.tail(10**8)
    finally:
        server.stop()
        pool.shutdown()
    assert len(engines) == 2, f"requests reached {len(engines)} engine core(s): {engines}"
    # each DP rank: 2 stored, 2 loaded what the other stored (DRAM), 2 loaded from SSD
    for lines_ in engines.values():
        assert [(x["saved"], x["hit_pool"], x["loaded"], x["failed"]) for x in lines_] == [
            (3, 0, 0, 0)
        ] * 2 + [(0, 3, 3, 0)] * 4, (
            engines,
            [ln for ln in log.splitlines() if "WARNING" in ln or "ERROR" in ln],
        )
    # A worker uses the client (and SSD tier) of its local rank (vLLM's device index: on
    # a GPU node DP rank 1's is slot 1). vLLM's CPU workers of both DP ranks are local
    # rank 0, so here both engines' KV regions are mapped by slot 0's client.
    slot0 = status.ranks[0].stats
    assert (slot0.put_keys, slot0.get_keys, slot0.regions) == (12, 12, 2), status.table()
    # the third round: DRAM misses, every block served by slot 0's SSD tier
    assert slot0.ssd_get_keys == 12 and status.total.lookup_ssd_blocks == 12, status.table()
    # Each engine's scheduler was told its worker's slot, and the SSD tiers the lookups
    # asked are exactly those.
    slots = _ssd_slots(log)
    assert set(slots) == set(engines), (slots, list(engines))
    assert set(slots.values()) == {(node, 0)}, slots
    assert {(n, s) for n, s, _ in lookup["ssd_asks"]} == set(slots.values()), lookup
