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
import ray

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


def _niceness(pid: int) -> dict[int, int]:
    """Each thread of ``pid``: its niceness (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


@pytest.mark.timeout(180)
def test_the_pools_actors_run_no_thread_above_niceness_zero(ray_cluster, mooncake_master):
    """Ray starts workers at niceness 15, and on Linux a niceness is per thread: an actor
    that reniced only the thread running its constructor kept its event loop at 15, where
    a busy engine starved it (its saves went unanswered for seconds). (A Ray started at a
    negative niceness leaves some of a worker's threads there: those stay.)"""
    from kvray import Pool
    from kvray.keys import KeySpace
    from kvray.naming import manager_name

    from .conftest import small_config

    cfg = small_config(mooncake_master.address, world_size=1)
    pool = Pool.start(cfg)
    try:
        space = KeySpace("nice", "float32-b16-h1x64")
        assert pool.lookup(space, [b"\1" * 32]) == 0  # the node's Lookup actor is up
        manager = ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
        pids = {
            "BackendClient": pool._h.client(0).probe().result(30)["pid"],
            "Lookup": pool._h.lookup().probe().result(30)["pid"],
            # (the block index's stream; and an embedded server inherits its niceness)
            "manager": ray.get(manager.__ray_call__.remote(lambda _: os.getpid()), timeout=30),
        }
        for role, pid in pids.items():
            niceness = _niceness(pid)
            assert niceness and max(niceness.values()) <= 0, (role, niceness)
    finally:
        pool.shutdown()
