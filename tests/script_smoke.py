"""Running the scripts of ``scripts/`` in their smoke mode, for ``tests/*/test_scripts.py``.

Every script whose name does not start with ``_`` has ``--smoke``: its full run with
small arguments (``SMOKE`` in the script), the same code path and the same JSON keys. A
test runs it in a subprocess, as a user would, and checks its exit status, that its
table was printed, and that its JSON has the keys of the full run: those of the full
run's committed result under ``bench-results/`` (made with the default arguments) where
there is one, else the keys its code writes, listed in the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvray.testing.engine import FORK_ENV

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RESULTS = ROOT / "bench-results"

SMOKE_TESTS = {
    "bench_channel.py": "tests/integration/test_scripts.py",
    "bench_layerwise.py": "tests/e2e/test_scripts.py",
    "bench_serve.py": "tests/e2e/test_scripts.py",
    "bench_route.py": "tests/e2e/test_scripts.py",
    "bench_ssd.py": "tests/integration/test_scripts.py",
    "bench_store.py": "tests/integration/test_scripts.py",  # --cross-node: tests/multinode
    "bench_ttft.py": "tests/e2e/test_scripts.py",
    "bench_workloads.py": "tests/e2e/test_scripts.py",
    "datasystem_cluster.py": "tests/integration/test_scripts.py",
    "demo_pool.py": "tests/integration/test_scripts.py",
    "demo_vllm.py": "tests/e2e/test_scripts.py",
    "device_check.py": "tests/unit/test_device_check.py",
    "pool_job.py": "tests/integration/test_scripts.py",
    "report.py": "tests/unit/test_docs_rendered.py",
    "soak.py": "tests/e2e/test_soak.py",
    "ttft_breakdown.py": "tests/e2e/test_scripts.py",
}
"""Each script, and the test module that runs it in its smoke mode."""

KEY_DEPTH = 4
"""Key paths deeper than this are not compared: there the JSON holds records of kvray's
own (a request's timeline), whose fields are kvray's to change, not the script's."""


def run_script(
    name: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    smoke: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``python scripts/<name> ARGS [--smoke]`` (the tests' environment plus ``env``; a
    benchmark's engines forked from the fork server: ``FORK_ENV``), asserted to exit 0;
    its output is returned."""
    cmd = [sys.executable, str(SCRIPTS / name), *args, *(["--smoke"] if smoke else [])]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, FORK_ENV: "1", **(env or {})},
        cwd=ROOT,
    )
    assert res.returncode == 0, (
        f"{' '.join(cmd)} exited {res.returncode}:\n"
        f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-8000:]}"
    )
    return res


def key_paths(obj: Any, prefix: str = "", depth: int = KEY_DEPTH) -> set[str]:
    """Every key of ``obj`` as a dotted path (list elements as ``name[]``: the union over
    the elements), down to ``depth`` keys."""
    out: set[str] = set()
    if depth == 0:
        return out
    if isinstance(obj, dict):
        for key, value in obj.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            out |= key_paths(value, path, depth - 1)
    elif isinstance(obj, list):
        for value in obj:
            out |= key_paths(value, prefix + "[]", depth)
    return out


def committed_keys(result: str) -> set[str]:
    """The key paths of the full run's committed ``bench-results/<result>``."""
    return key_paths(json.loads((RESULTS / result).read_text()))


def json_keys(path: Path) -> set[str]:
    return key_paths(json.loads(path.read_text()))
