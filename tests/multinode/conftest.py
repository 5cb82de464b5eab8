"""The multi-node harness (``kvray.testing.multinode``): two Ray nodes on this machine
that share no /dev/shm, with a driver helper for tests/multinode/node_driver.py."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvray.testing.multinode import RESULT, TwoNodeCluster, unavailable_reason

HERE = Path(__file__).parent


class Cluster(TwoNodeCluster):
    def run(
        self, node: str, *args: str, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """``tests/multinode/node_driver.py ARGS`` as a driver on ``node``."""
        return self.run_script(
            node, str(HERE / "node_driver.py"), *args, check=check, timeout=timeout
        )

    def json(self, node: str, *args: str) -> Any:
        """The driver's JSON answer (its line marked ``RESULT``; Ray may print other
        lines to stdout around it)."""
        out = self.run(node, *args).stdout
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
        assert lines, f"node_driver {args} printed no result:\n{out[-3000:]}"
        return json.loads(lines[-1][len(RESULT) :])


@pytest.fixture(scope="session")
def two_nodes():  # type: ignore[no-untyped-def]
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    from kvray.testing.vllm_ray_cpu import ENV

    # One GPU resource per node and the test-only platform in the raylets' environment:
    # slots for vLLM's Ray executor (test_tp_across_nodes.py); inert for everything else.
    with (
        tempfile.TemporaryDirectory(prefix="kvray-mn-") as tmp,
        Cluster(Path(tmp), gpus=1, raylet_env={ENV: "1"}) as cluster,
    ):
        yield cluster
