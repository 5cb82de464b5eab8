"""kvray.ray_env.ray_init keeps a process's own SIGTERM handler.

``ray.init`` replaces it with ``sys.exit`` and Ray's core worker adds a C-level handler
that prints "*** SIGTERM received" and a stack. In a vLLM engine process (where the
connector joins Ray) that replaced vLLM's graceful shutdown, and every normal stop of
``make demo`` printed a stack dump.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

CHILD = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
from kvray.ray_env import ray_init
ray_init(sys.argv[1])
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("own handler ran" if got else "own handler did not run", flush=True)
"""


@pytest.mark.timeout(120)
def test_sigterm_reaches_the_process_own_handler(ray_cluster):
    res = subprocess.run(
        [sys.executable, "-c", CHILD, ray_cluster],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert "own handler ran" in res.stdout, res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SIGTERM received" not in res.stderr
