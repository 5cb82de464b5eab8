"""The pool's KV events across a node loss: blocks described and stored from
both nodes are published; node B dies (its Mooncake segment, and the only copies of the
blocks stored through it, with it); the manager on A finds B lost, asks the backend about
the DRAM blocks its events announced, and publishes the gone ones removed. A subscriber
built from vLLM's types (on node A: the harness's addresses live in its namespaces)
replays the stream and holds exactly what ``exists()`` shows."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
pytest.importorskip("vllm", reason="the pool's publisher encodes vLLM's own event types")


def _settle(two_nodes, pool: str, seeds: list[str], want: list[str], deadline_s: float) -> None:  # type: ignore[no-untyped-def]
    """Until the subscriber holds ``want`` and exists() shows the same, and still does 2 s
    later (quiescence plus 2 s)."""
    deadline = time.monotonic() + deadline_s
    while True:
        got = two_nodes.json("A", "events", pool, *seeds)
        if got["held"] == got["whole"] == want:
            time.sleep(2)
            again = two_nodes.json("A", "events", pool, *seeds)
            assert again["held"] == again["whole"] == want, again
            return
        assert time.monotonic() < deadline, f"the stream never matched {want}: {got}"
        time.sleep(2)


def test_events_match_the_pool_after_a_node_loss(two_nodes):
    pool = "mnev"
    started = two_nodes.json("A", "start-events", pool)
    assert started["events"]["endpoint"].startswith("tcp://10.77.0.1:"), started
    try:
        on_b = two_nodes.json("B", "put-blocks", pool, "1", "4")
        on_a = two_nodes.json("A", "put-blocks", pool, "2", "4")
        assert on_b["client_node"] != on_a["client_node"]
        _settle(two_nodes, pool, ["1", "2"], sorted(on_a["hashes"] + on_b["hashes"]), 60)
        assert two_nodes.kill_node("B") > 0
        # Mooncake drops B's segment after client_ttl_s (10 s); Ray declares B dead after
        # its health checks fail; the manager's node watch then asks about the announced blocks.
        _settle(two_nodes, pool, ["1", "2"], sorted(on_a["hashes"]), 240)
    finally:
        if two_nodes.nodes["B"].raylet is None:  # later tests need it
            two_nodes.restart_node("B")
        two_nodes.run("A", "down", pool, check=False)
