"""KVRayConnector under vLLM's Ray executor on one node: the worker is a Ray actor in
vLLM's placement group and gets its node's client from the pool manager. vLLM 0.32's CPU
platform refuses Ray, so the engine and its worker run the test-only platform plugin
``kvray.testing.vllm_ray_cpu`` (the CPU platform with workers placed as Ray ``GPU``
resources; the session's Ray cluster advertises one). Across two nodes with TP=2:
tests/multinode/test_tp_across_nodes.py."""

from __future__ import annotations

import contextlib
import glob
import os

import pytest

from kvray.connector.log_lines import request_counts
from kvray.testing.vllm_ray_cpu import ENV

from .conftest import BLOCK, prompts, psm_left_behind, run_engine

pytestmark = pytest.mark.e2e


def test_ray_executor_loads_from_pool(pool, ray_cluster, tiny_model, tmp_path):
    prompt = prompts(7, 3 * BLOCK + 7)
    spec = {
        "model": tiny_model,
        "connector": {"extra": {"pool_name": "e2e", "namespace": "kvray"}},
        "executor": "ray",
        "env": {ENV: "1", "VLLM_HOST_IP": "127.0.0.1"},
        "ray_env": {ENV: "1"},
        "runs": [[prompt], [prompt]],
        "wait_saves_for": "e2e",
    }
    before = set(glob.glob("/dev/shm/psm_*"))
    try:
        out = run_engine(ray_cluster, tmp_path, "ray-executor", spec)
    finally:
        # vLLM's Ray executor kills its worker actors (ray.kill) at shutdown, so the
        # shared-memory response queue each worker created is never unlinked: a
        # 240 MiB psm_* segment per worker stays in /dev/shm. Not kvray's (run_engine
        # already checked that no kvray region is left); removed so that the test
        # leaves nothing behind.
        for path in psm_left_behind(before):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    first, second = (r["outputs"][0] for r in out["runs"])
    assert first == second
    assert "RayWorkerProc" in out["log"], out["log"][-3000:]  # vLLM's Ray worker actor
    counts = [(ln["hit_pool"], ln["loaded"]) for ln in request_counts(out["log"])]
    assert counts == [(0, 0), (3, 3)], out["log"][-3000:]
