"""KVRayConnector under vLLM's Ray executor (workers are Ray actors and get the client of
their own node and local rank from the pool manager). vLLM 0.32 refuses the Ray executor
on the CPU platform, so this runs only where vLLM has an accelerator platform (CUDA)."""

from __future__ import annotations

import pytest

from .conftest import BLOCK, prompts, run_engine

pytestmark = pytest.mark.e2e


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@pytest.mark.skipif(
    _cpu_platform(),
    reason="vLLM 0.32's Ray executor does not run on the CPU platform "
    "(ValueError: current platform cpu does not support ray); needs a GPU machine",
)
def test_ray_executor_loads_from_pool(pool, ray_cluster, tiny_model, tmp_path):
    prompt = prompts(7, 3 * BLOCK + 7)
    spec = {
        "model": tiny_model,
        "connector": {"extra": {"pool_name": "e2e", "namespace": "kvray"}},
        "executor": "ray",
        "runs": [[prompt], [prompt]],
        "wait_saves_for": "e2e",
    }
    out = run_engine(ray_cluster, tmp_path, "ray-executor", spec)
    first, second = (r["outputs"][0] for r in out["runs"])
    assert first == second
    assert "hit_pool=3" in out["log"] and "loaded=3" in out["log"]
