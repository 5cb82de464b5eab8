"""The multi-node harness (``kvray.testing.multinode``): two Ray nodes on this machine
that share no /dev/shm, with a driver helper for tests/multinode/node_driver.py."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvray.testing.multinode import TwoNodeCluster, result_of, unavailable_reason

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
        return result_of(self.run(node, *args).stdout)


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
