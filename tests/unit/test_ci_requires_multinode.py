"""CI must fail, not skip, a multinode test whose harness cannot run here
(KVRAY_REQUIRE_MULTINODE, set by .ci/run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/multinode/test_pool_across_nodes.py::test_wrong_node_is_a_clear_error"
RUN = (
    "import sys, pytest, kvray.testing.multinode as mn; "
    "mn.unavailable_reason = lambda: 'no namespaces (made so by this test)'; "
    f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', {TEST!r}]))"
)


def _run(require: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVRAY_REQUIRE_MULTINODE": require}
    return subprocess.run(
        [sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_an_unavailable_harness_fails_the_run_when_required():
    required = _run("1")
    assert required.returncode != 0, required.stdout[-2000:]
    assert "KVRAY_REQUIRE_MULTINODE=1: a multinode test may not skip" in required.stdout
    assert "made so by this test" in required.stdout
    skipped = _run("0")  # a developer without root still runs the rest
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
