"""One pool, two Ray nodes that share no /dev/shm: each node's drivers use clients on
their own node, and blocks stored through one node are read through the other (Mooncake
over TCP between the nodes' segments)."""

from __future__ import annotations

import time

import pytest

from kvray.testing.multinode import NODE_IPS

pytestmark = pytest.mark.integration


def test_pool_api_from_both_nodes(two_nodes):
    started = two_nodes.json("A", "start", "mn")
    try:
        assert sorted(two_nodes.json("B", "nodes")) == sorted(NODE_IPS.values())
        # The embedded master listens on node A's address (the cluster has two nodes),
        # which node B reaches; never on loopback, which B cannot.
        assert started["server"].startswith(NODE_IPS["A"] + ":"), started
        # A driver on node B gets a client on node B (made on first use), not node A's.
        put_b = two_nodes.json("B", "put", "mn", "from-b", "7")
        assert put_b["client_node"] == put_b["node"] != started["node"]
        put_a = two_nodes.json("A", "put", "mn", "from-a", "8")
        assert put_a["client_node"] == put_a["node"] == started["node"]
        # Each node reads what the other stored, byte for byte.
        got_a = two_nodes.json("A", "get", "mn", "from-b", "7")
        got_b = two_nodes.json("B", "get", "mn", "from-a", "8")
        assert got_a["hit"] and got_a["equal"], got_a
        assert got_b["hit"] and got_b["equal"], got_b
        # A key nobody stored is a miss on either node, never other bytes.
        assert two_nodes.json("B", "get", "mn", "nobody", "9")["hit"] is False
        status = two_nodes.json("B", "status", "mn")
        nodes = {r["node"].split("/")[0] for r in status["ranks"]}
        assert nodes == set(NODE_IPS.values()), status["table"]
        assert all(r["alive"] for r in status["ranks"]), status["table"]
        assert set(status["nodes"]) == {r["node"] for r in status["ranks"]}
        assert all(v == 64 << 20 for v in status["nodes"].values()), status["nodes"]
        assert "per node:" in status["table"]
    finally:
        two_nodes.run("A", "down", "mn", check=False)


def test_wrong_node_is_a_clear_error(two_nodes):
    """Shared memory does not cross nodes: a region handed to another node's client is
    refused with the fix (the harness's nodes share a kernel but not /dev/shm)."""
    two_nodes.json("A", "start", "mnw")
    try:
        two_nodes.json("A", "put", "mnw", "a", "1")  # node A's client exists
        out = two_nodes.json("B", "wrong-node", "mnw")
        assert out["refused"], out
        assert "another node" in out["error"] and "same node" in out["error"]
    finally:
        two_nodes.run("A", "down", "mnw", check=False)


def test_a_loopback_server_is_refused_at_attach_on_another_node(two_nodes):
    """A pool whose embedded master listens on loopback (``server_host: loopback``) serves
    its own node; a client on the other node cannot reach it (on real hosts, as here, that
    address is the client's own node) and is refused when it attaches, naming the fix,
    in seconds, while status and doctor still answer there."""
    started = two_nodes.json("A", "start", "mlo", "1", "loopback")
    try:
        assert started["server"].startswith("127.0.0.1:"), started
        assert two_nodes.json("A", "attach", "mlo")["refused"] is False
        out = two_nodes.json("B", "attach", "mlo")
        assert out["refused"] and out["took_s"] < 10, out
        assert "server_host: node" in out["error"] and NODE_IPS["B"] in out["error"], out
        assert "server_host: loopback" in out["error"], out
        code = "import sys; from kvray.cli import main; sys.exit(main(['--name', 'mlo', 'doctor']))"
        doctor = two_nodes.run_python("B", code, check=False)
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        assert "pool from this node" in doctor.stdout and "server_host: node" in doctor.stdout
    finally:
        two_nodes.run("A", "down", "mlo", check=False)


@pytest.mark.timeout(600)  # a node killed, noticed by Ray, restarted: ~65 s when idle
@pytest.mark.parametrize("replicas", [1, 2])
def test_node_loss(two_nodes, replicas):
    """Node B dies (every process of it SIGKILLed). Node A keeps serving: a block whose
    only copy lived in B's segment becomes a miss, never other bytes, while with
    replica_num 2 its second copy serves it; status shows B gone; B comes back and
    serves again."""
    pool = f"mnl{replicas}"
    two_nodes.json("A", "start", pool, str(replicas))
    try:
        two_nodes.json("B", "put", pool, "on-b", "5")
        two_nodes.json("A", "put", pool, "on-a", "6")
        assert two_nodes.json("A", "get", pool, "on-b", "5")["equal"]
        assert two_nodes.kill_node("B") > 0
        deadline = time.monotonic() + 60
        seen = []
        while True:  # the master drops B's segment after client_ttl_s (2 s here)
            t0 = time.monotonic()
            got = two_nodes.json("A", "get", pool, "on-b", "5")
            seen.append((got["hit"], got["failed"], round(time.monotonic() - t0, 1)))
            assert not got["hit"] or got["equal"], f"wrong bytes after node loss: {got}"
            if replicas == 2 or not (got["hit"] or got["failed"]):
                break
            assert time.monotonic() < deadline, f"never a clean miss: {seen}"
            time.sleep(1)
        # (hit, failed, seconds) per get: a failed transfer is reported, never bytes
        assert all(took < 30 for *_, took in seen), f"a get took too long: {seen}"
        if replicas == 2:
            assert got["hit"] and got["equal"], seen
        else:
            assert not got["hit"] and not got["failed"], seen
        assert two_nodes.json("A", "get", pool, "on-a", "6")["equal"]
        while True:  # Ray declares the node dead after its health checks fail
            status = two_nodes.json("A", "status", pool)
            gone = [r for r in status["ranks"] if r["node"].startswith(NODE_IPS["B"] + "/")]
            assert gone and not any(r["alive"] for r in gone), status["table"]
            if all(r["error"] == "node gone" for r in gone):
                break
            assert time.monotonic() < deadline + 60, status["table"]
            time.sleep(2)
        two_nodes.restart_node("B")
        two_nodes.json("B", "put", pool, "back-on-b", "7")
        assert two_nodes.json("B", "get", pool, "back-on-b", "7")["equal"]
        assert two_nodes.json("B", "get", pool, "on-a", "6")["equal"]
    finally:
        if two_nodes.nodes["B"].raylet is None:  # failed while B was down: later tests need it
            two_nodes.restart_node("B")
        two_nodes.run("A", "down", pool, check=False)
