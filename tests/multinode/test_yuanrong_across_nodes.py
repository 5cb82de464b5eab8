"""openYuanrong datasystem across nodes that share no network: one datasystem worker per
node, started as production starts them (scripts/datasystem_cluster.py: etcd on node A,
each node's worker on its own address, node B's joining A's etcd), and one pool whose
clients each connect to their own node's worker (``yuanrong.node_worker_addresses``).
Each node reads byte-exact what the other stored (the workers move the bytes between
them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvray.testing.multinode import NODE_IPS

# find_spec, not an import: every xdist worker collects this module, and a process that
# imported yr.datasystem before mooncake dies of a SIGSEGV at mooncake's import (kvray
# imports them in the other order: kvray.backends.yuanrong.import_datasystem). An import
# here took six workers down, at the first in-process Mooncake client of their tests.
if importlib.util.find_spec("yr") is None:
    pytest.skip("openYuanrong datasystem is not installed", allow_module_level=True)

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).parents[2] / "scripts" / "datasystem_cluster.py")


@pytest.mark.timeout(600)
def test_yuanrong_with_a_worker_per_node(two_nodes, tmp_path):
    dirs = {node: tmp_path / f"ds-{node}" for node in ("A", "B")}
    small = ["--workers", "1", "--shared-memory-mb", "128"]
    try:
        two_nodes.run_script("A", SCRIPT, "up", "--dir", str(dirs["A"]), "--host",
                             NODE_IPS["A"], *small, timeout=150)  # fmt: skip
        on_a = json.loads((dirs["A"] / "cluster.json").read_text())
        two_nodes.run_script("B", SCRIPT, "up", "--dir", str(dirs["B"]), "--host",
                             NODE_IPS["B"], "--etcd", on_a["etcd_address"], *small,
                             timeout=150)  # fmt: skip
        on_b = json.loads((dirs["B"] / "cluster.json").read_text())
        workers = {NODE_IPS["A"]: on_a["workers"][0]["address"],
                   NODE_IPS["B"]: on_b["workers"][0]["address"]}  # fmt: skip
        assert all(w.startswith(ip + ":") for ip, w in workers.items()), workers
        two_nodes.json("A", "start-yuanrong", "myr", json.dumps(workers))
        try:
            two_nodes.json("A", "put", "myr", "from-a", "8")
            two_nodes.json("B", "put", "myr", "from-b", "7")
            got_b = two_nodes.json("B", "get", "myr", "from-a", "8")
            got_a = two_nodes.json("A", "get", "myr", "from-b", "7")
            assert got_b["hit"] and got_b["equal"], got_b
            assert got_a["hit"] and got_a["equal"], got_a
            assert two_nodes.json("B", "get", "myr", "nobody", "9")["hit"] is False
            status = two_nodes.json("A", "status", "myr")
            # each node's client uses its own node's worker
            segments = {r["node"].split("/")[0]: r["segment"] for r in status["ranks"]}
            assert segments == {ip: f"worker {w}" for ip, w in workers.items()}, status["table"]
        finally:
            two_nodes.run("A", "down", "myr", check=False)
    finally:
        for node, home in dirs.items():
            if home.exists():
                two_nodes.run_script(node, SCRIPT, "down", "--dir", str(home), check=False)
