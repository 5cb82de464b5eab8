"""The manager's watch for lost nodes (kvray/index/node_loss.py), without Ray: a real
:class:`~kvray.index.stream.IndexHub`, and FAKES for the alive-nodes source, the pool's KV
events and the clients asked about DRAM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from kvray.index.block_index import DRAM, GONE, key_digests
from kvray.index.kv_events import CPU
from kvray.index.node_loss import DramClient, NodeLossWatch, SegmentLoss
from kvray.index.stream import OP_ADD, IndexChange, IndexHub


class FakeAlive:
    """FAKE alive-nodes source: a dict the test edits; ``fail`` makes the next ask raise."""

    def __init__(self, *nodes: str) -> None:
        self.nodes = {n: f"10.0.0.{i}" for i, n in enumerate(nodes)}
        self.fail = 0

    async def __call__(self) -> dict[str, str]:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the GCS does not answer")
        return dict(self.nodes)


class FakeDramClient:
    """FAKE BackendClient: holds ``held`` in DRAM; records each ``dram_exists`` batch and
    each ask to reconcile (answered with ``stored``); ``fail`` makes the next call raise."""

    def __init__(self, held: Iterable[str] = (), stored: int = 0) -> None:
        self.held = set(held)
        self.asked: list[list[str]] = []
        self.stored = stored
        self.reconciles = 0
        self.fail = 0

    async def reconcile_all(self) -> int:
        if self.fail:
            self.fail -= 1
            raise TimeoutError("reconcile_all timed out")
        self.reconciles += 1
        return self.stored

    async def dram_exists(self, keys: list[str]) -> list[bool]:
        self.asked.append(list(keys))
        if self.fail:
            self.fail -= 1
            raise TimeoutError("dram_exists timed out")
        return [k in self.held for k in keys]


class FakeEvents:
    """FAKE KV events: announces those of ``keys`` that ``hub``'s index shows in DRAM (as
    the real catalog does once told of a change); records what it is told changed."""

    def __init__(self, hub: IndexHub, keys: list[str]) -> None:
        self.hub = hub
        self.keys = keys
        self.changes: list[np.ndarray] = []

    def keys_in(self, medium: str) -> tuple[np.ndarray, list[str]]:
        assert medium == CPU, medium
        ks = [k for k, t in zip(self.keys, tiers(self.hub, self.keys)) if t & DRAM]
        return key_digests(ks), ks

    def changed(self, digests: Iterable[np.ndarray]) -> None:
        self.changes += [np.asarray(d, dtype=np.uint64) for d in digests]

    def changed_digests(self) -> set[int]:
        return {int(x) for d in self.changes for x in d.tolist()}


def keys(n: int, first: int = 0) -> list[str]:
    return [f"ns@l@tp0@pp0@{i:08x}" for i in range(first, first + n)]


def add(hub: IndexHub, ks: list[str], node: str = "", slot: int = -1) -> None:
    hub.record([IndexChange(OP_ADD, key_digests(ks).astype("<u8").tobytes(), node, slot)])


def tiers(hub: IndexHub, ks: list[str]) -> list[int]:
    return [int(t) for t in hub.index.tiers(key_digests(ks))]


def watch(
    hub: IndexHub,
    alive: FakeAlive,
    clients: dict[str, FakeDramClient],
    events: FakeEvents | None = None,
    **kw: Any,
) -> NodeLossWatch:
    def by_node() -> list[tuple[str, DramClient]]:
        return [(node, c) for node, c in sorted(clients.items())]

    return NodeLossWatch("p", hub, events, alive, by_node, **kw)


async def test_a_lost_node_takes_its_ssd_places_out_of_the_index_once():
    hub = IndexHub(4096)
    ssd_a, ssd_b, dram = keys(10), keys(10, 100), keys(10, 200)
    add(hub, ssd_a, "node-a", 0)
    add(hub, ssd_b, "node-b", 0)
    add(hub, dram)
    alive = FakeAlive("node-a", "node-b")
    clients = {"node-a": FakeDramClient(), "node-b": FakeDramClient()}
    w = watch(hub, alive, clients)
    assert await w.step() == []  # every node alive: nothing changes
    assert tiers(hub, ssd_a) == [hub.index.place_bit("node-a", 0)] * 10

    del alive.nodes["node-a"]
    assert await w.step() == ["node-a"]
    assert tiers(hub, ssd_a) == [GONE] * 10  # a lookup misses them as evicted
    assert tiers(hub, ssd_b) == [hub.index.place_bit("node-b", 0)] * 10
    assert tiers(hub, dram) == [DRAM] * 10
    seq = hub.seq
    assert await w.step() == [] and hub.seq == seq  # handled once
    assert clients["node-b"].asked == []  # no KV events: nothing says which DRAM blocks


async def test_a_node_known_only_by_its_ssd_places_is_reconciled_too():
    hub = IndexHub(4096)
    add(hub, keys(4), "node-c", 1)  # a client of a manager before a restart
    w = watch(hub, FakeAlive("node-a"), {"node-a": FakeDramClient()})
    assert await w.step() == ["node-c"]
    assert tiers(hub, keys(4)) == [GONE] * 4


async def test_announced_dram_blocks_are_asked_of_a_live_client_and_the_gone_recorded():
    hub = IndexHub(4096)
    announced = keys(7)
    add(hub, announced)
    ssd = keys(3, 50)
    add(hub, ssd, "node-a", 0)
    events = FakeEvents(hub, announced)
    held = announced[:2] + announced[5:]  # node-a's memory held the other three
    # node-a's own client is first in order, and must not be asked: its node is gone.
    clients = {"node-a": FakeDramClient(announced), "node-b": FakeDramClient(held)}
    alive = FakeAlive("node-a", "node-b")
    w = watch(hub, alive, clients, events, batch=3, recheck_s=3600)
    del alive.nodes["node-a"]
    assert await w.step() == ["node-a"]
    w.close()

    assert clients["node-a"].asked == []
    assert clients["node-b"].asked == [announced[0:3], announced[3:6], announced[6:7]]
    assert tiers(hub, announced) == [DRAM, DRAM, GONE, GONE, GONE, DRAM, DRAM]
    assert tiers(hub, ssd) == [GONE] * 3
    gone = {int(x) for x in key_digests(announced[2:5]).tolist()}
    assert events.changed_digests() == gone | {int(x) for x in key_digests(ssd).tolist()}


async def test_no_live_client_means_no_dram_check():
    hub = IndexHub(4096)
    add(hub, keys(4))
    lone = FakeDramClient()
    alive = FakeAlive("node-a")
    w = watch(hub, alive, {"node-a": lone}, FakeEvents(hub, keys(4)), recheck_s=3600)
    alive.nodes.clear()
    assert await w.step() == ["node-a"]
    w.close()
    assert lone.asked == [] and tiers(hub, keys(4)) == [DRAM] * 4


async def test_the_recheck_finds_what_the_backend_dropped_later():
    hub = IndexHub(4096)
    announced = keys(6)
    add(hub, announced)
    events = FakeEvents(hub, announced)
    live = FakeDramClient(announced)  # at the first check the backend still holds all
    alive = FakeAlive("node-a", "node-b")
    w = watch(hub, alive, {"node-a": FakeDramClient(), "node-b": live}, events, recheck_s=0)
    del alive.nodes["node-a"]
    assert await w.step() == ["node-a"]
    assert len(live.asked) == 1 and tiers(hub, announced) == [DRAM] * 6
    live.held -= set(announced[4:])  # then it drops the dead client's memory
    for _ in range(100):  # the signal: the client was asked again (not the index)
        if len(live.asked) == 2:
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(live.asked) == 2
    assert tiers(hub, announced) == [DRAM] * 4 + [GONE] * 2
    assert await w.recheck("node-a") == 0  # nothing more gone


async def test_a_failed_dram_check_is_logged_and_the_recheck_still_runs(caplog):
    hub = IndexHub(4096)
    announced = keys(4)
    add(hub, announced)
    add(hub, keys(2, 90), "node-a", 0)
    events = FakeEvents(hub, announced)
    live = FakeDramClient(announced[:1])
    live.fail = 1
    alive = FakeAlive("node-a", "node-b")
    w = watch(hub, alive, {"node-b": live}, events, recheck_s=3600)
    del alive.nodes["node-a"]
    with caplog.at_level(logging.ERROR, "kvray"):
        assert await w.step() == ["node-a"]
    w.close()
    assert "reconciling lost node node-a failed" in caplog.text
    assert tiers(hub, keys(2, 90)) == [GONE] * 2  # the SSD part held
    assert tiers(hub, announced) == [DRAM] * 4
    assert await w.recheck("node-a") == 3
    assert tiers(hub, announced) == [DRAM] + [GONE] * 3


async def test_the_loop_goes_on_after_a_failed_pass(caplog):
    hub = IndexHub(4096)
    add(hub, keys(2), "node-a", 0)
    alive = FakeAlive("node-b")
    alive.fail = 2
    w = watch(hub, alive, {"node-b": FakeDramClient()}, watch_s=0)
    with caplog.at_level(logging.ERROR, "kvray"):
        task = asyncio.create_task(w.run())
        for _ in range(100):  # the signal: the watch handled the node
            if w.handled:
                break
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert caplog.text.count("node watch pass failed") == 2
    assert w.handled == {"node-a"}
    assert tiers(hub, keys(2)) == [GONE] * 2


async def test_a_short_answer_from_the_client_is_a_failure_not_a_verdict(caplog):
    """A client that answers fewer keys than asked must not shift the gone mask."""
    hub = IndexHub(4096)
    announced = keys(4)
    add(hub, announced)

    class FakeShortClient(FakeDramClient):
        async def dram_exists(self, keys: list[str]) -> list[bool]:
            return (await super().dram_exists(keys))[:-1]

    alive = FakeAlive("node-a", "node-b")
    w = watch(hub, alive, {"node-b": FakeShortClient()}, FakeEvents(hub, announced))
    del alive.nodes["node-a"]
    with caplog.at_level(logging.ERROR, "kvray"):
        assert await w.recheck("node-a") == 0
    assert "answered 3 of 4 keys" in caplog.text
    assert tiers(hub, announced) == [DRAM] * 4


def master(capacity: int, clients: int, mounts: int, remounts: int, unmounts: int = 0) -> dict:  # type: ignore[type-arg]
    """The master's metrics :class:`SegmentLoss` reads, as a scrape returns them."""
    return {
        "master_total_capacity_bytes": float(capacity),
        "master_active_clients": float(clients),
        "master_mount_segment_requests_total": float(mounts),
        "master_remount_segment_requests_total": float(remounts),
        "master_unmount_segment_requests_total": float(unmounts),
        "master_key_count": 200.0,
    }


def test_segment_loss_reads_the_masters_segments_as_mooncake_counts_them():
    """The sequences a real mooncake_master (0.3) showed: a client joining counts a mount
    and a remount; a client stalled past client_ttl is dropped (capacity and active
    clients fall) and mounts again once it runs (a remount alone)."""
    seg = 64 << 20
    loss = SegmentLoss()
    assert loss.seen(master(0, 0, 0, 0)) is None  # the first read: nothing to compare
    assert loss.seen(master(seg, 1, 1, 1)) is None  # a client joined
    assert loss.seen(master(2 * seg, 2, 2, 2)) is None  # another
    assert loss.seen(master(2 * seg, 2, 2, 2)) is None
    assert loss.seen(master(seg, 1, 2, 2)) == f"its capacity fell by {seg} bytes"  # dropped
    assert loss.seen(master(2 * seg, 2, 2, 3)) == "a client mounted its segment again"
    # Dropped and mounted again between two reads: only the remount shows.
    assert loss.seen(master(2 * seg, 2, 2, 4)) == "a client mounted its segment again"
    assert loss.seen(master(2 * seg, 1, 2, 4)) == "1 client(s) left"
    assert loss.seen(master(2 * seg, 1, 2, 4, unmounts=1)) == "a client unmounted its segment"
    assert loss.seen(master(0, 0, 0, 0)) == f"its capacity fell by {2 * seg} bytes"  # restarted
    assert loss.seen({"master_key_count": 1.0}) is None  # not a Mooncake master's metrics
    assert loss.seen({}) is None


async def test_a_lost_segment_has_every_live_client_reconcile_and_checks_the_announced():
    hub = IndexHub(4096)
    announced = keys(5)
    add(hub, announced)
    events = FakeEvents(hub, announced)
    clients = {
        "node-a": FakeDramClient(announced[:3], stored=40),
        "node-b": FakeDramClient(announced[:3], stored=2),
        "node-c": FakeDramClient(stored=7),  # its node is gone: not asked
    }
    w = watch(hub, FakeAlive("node-a", "node-b"), clients, events)
    assert await w.segment_lost("a client mounted its segment again") == (42, 2)
    assert [c.reconciles for c in clients.values()] == [1, 1, 0]
    assert tiers(hub, announced) == [DRAM] * 3 + [GONE] * 2
    assert events.changed_digests() == {int(x) for x in key_digests(announced[3:]).tolist()}


async def test_a_client_that_does_not_take_the_reconcile_is_logged_and_the_rest_go_on(caplog):
    hub = IndexHub(4096)
    slow, ok = FakeDramClient(stored=5), FakeDramClient(stored=3)
    slow.fail = 1
    w = watch(hub, FakeAlive("node-a", "node-b"), {"node-a": slow, "node-b": ok})
    with caplog.at_level(logging.WARNING, "kvray"):
        assert await w.segment_lost("1 client(s) left") == (3, 0)  # no events: no DRAM check
    assert ok.reconciles == 1
    assert "did not take the ask to reconcile: reconcile_all timed out" in caplog.text
    assert "let a segment go (1 client(s) left)" in caplog.text
