"""The block-index stream (kvray/index/stream.py): the manager's hub applies and logs each
client's changes, a node's keeper follows it with long polls and gets a snapshot when the
log no longer reaches its position; the keeper's index then answers as the hub's does,
with the hub's tier bits."""

from __future__ import annotations

import asyncio

import numpy as np

from kvray.errors import KVRayError
from kvray.index.block_index import DRAM, GONE, REMOVED, BlockIndex, key_digests
from kvray.index.stream import OP_ADD, OP_GONE, OP_REMOVE, IndexChange, IndexHub, IndexKeeper


def change(op: int, keys: list[str], node: str = "", slot: int = -1) -> IndexChange:
    return IndexChange(op, key_digests(keys).astype("<u8").tobytes(), node, slot)


def keys(n: int, first: int = 0) -> list[str]:
    return [f"ns@l@tp0@pp0@{i:08x}" for i in range(first, first + n)]


def same(hub: IndexHub, keeper: IndexKeeper, probe: list[str]) -> None:
    d = key_digests(probe)
    assert (hub.index.tiers(d) == keeper.index.tiers(d)).all()
    assert hub.index.places() == keeper.index.places()


def test_a_keeper_follows_changes_and_snapshots():
    hub = IndexHub(4096, log_digests=64)
    keeper = IndexKeeper(BlockIndex.create(4096))
    k = keys(40)
    hub.record([change(OP_ADD, k[:20]), change(OP_ADD, k[10:30], "node-b", 2)])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))  # first: another epoch, a snapshot
    assert keeper.snapshots == 1 and keeper.seq == hub.seq == 2
    same(hub, keeper, k)
    ssd = hub.index.place_bit("node-b", 2)
    assert keeper.index.tiers(key_digests(k[15:16])).tolist() == [DRAM | ssd]

    # Changes after its position: applied one by one, with the markers of why keys left.
    hub.record([change(OP_REMOVE, k[:5]), change(OP_GONE, k[5:10]), change(OP_ADD, k[30:], "n", 0)])
    update = hub.since(keeper.epoch, keeper.seq)
    assert update.snapshot is None and len(update.changes) == 3
    keeper.apply(update)
    same(hub, keeper, k)
    assert keeper.index.tiers(key_digests(k[:1])).tolist() == [REMOVED]
    assert keeper.index.tiers(key_digests(k[5:6])).tolist() == [GONE]
    assert keeper.index.age_s() < 5

    # Behind what the log keeps (64 digests): a snapshot again, and the same answers.
    for i in range(10):
        hub.record([change(OP_ADD, keys(20, 100 + 20 * i))])
    update = hub.since(keeper.epoch, keeper.seq)
    assert update.snapshot is not None
    keeper.apply(update)
    assert keeper.snapshots == 2
    same(hub, keeper, k + keys(200, 100))

    # A new hub (the manager restarted): another epoch, so everything is replaced.
    new = IndexHub(4096)
    new.record([change(OP_ADD, k[:3], "other", 1)])
    keeper.apply(new.since(keeper.epoch, keeper.seq))
    same(new, keeper, k)
    assert not keeper.index.tiers(key_digests(k[30:])).any()


def test_a_lost_nodes_ssd_places_leave_the_index_and_the_keepers_follow():
    hub = IndexHub(4096)
    keeper = IndexKeeper(BlockIndex.create(4096))
    k = keys(30)
    hub.record([
        change(OP_ADD, k[:10]), change(OP_ADD, k[5:15], "node-b", 0),
        change(OP_ADD, k[12:20], "node-b", 1), change(OP_ADD, k[18:30], "node-c", 0),
    ])  # fmt: skip
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    changes = hub.node_lost("node-b")
    assert [(c.op, c.node_id, c.slot, len(c.digests) // 8) for c in changes] == [
        (OP_GONE, "node-b", 0, 10), (OP_GONE, "node-b", 1, 8)]  # fmt: skip
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    tiers = keeper.index.tiers(key_digests(k))
    c0 = keeper.index.place_bit("node-c", 0, register=False)
    assert tiers[:10].tolist() == [DRAM] * 10  # DRAM copies stay (the backend says)
    assert tiers[10:18].tolist() == [GONE] * 8  # only on node-b: gone, missed as evicted
    assert tiers[18:20].tolist() == [c0] * 2 and tiers[20:].tolist() == [c0] * 10
    assert hub.node_lost("node-b") == [] and hub.node_lost("node-x") == []


def test_a_long_poll_answers_when_something_is_recorded_or_at_its_limit():
    hub = IndexHub(1024)

    async def scenario() -> None:
        first = await hub.wait("", 0, 0.01)  # another epoch: answered at once
        assert first.epoch == hub.epoch and first.seq == 0
        t = asyncio.get_running_loop().time()
        idle = await hub.wait(hub.epoch, 0, 0.05)
        assert idle.changes == [] and asyncio.get_running_loop().time() - t >= 0.04
        waiting = asyncio.ensure_future(hub.wait(hub.epoch, 0, 10))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        hub.record([change(OP_ADD, keys(3))])
        got = await asyncio.wait_for(waiting, 1)
        assert got.seq == 1 and len(got.changes) == 1
        np.testing.assert_array_equal(np.frombuffer(got.changes[0][2], "<u8"), key_digests(keys(3)))

    asyncio.run(scenario())


def test_a_keeper_applies_its_own_nodes_changes_at_once_and_again_from_the_stream():
    """Its node's changes count at once (an SSD place the hub has not named waits for it),
    and again after every update from the hub until the hub sends them back, so a snapshot
    taken before the hub had them (it replaces everything) does not lose them (seen: a DRAM
    store lost for good)."""
    hub = IndexHub(4096)
    keeper = IndexKeeper(BlockIndex.create(4096))
    k = keys(10)
    ours = [change(OP_ADD, k[:5]), change(OP_ADD, k[:5], "node-a", 0)]
    keeper.apply_local(ours)
    assert keeper.index.tiers(key_digests(k[:5])).tolist() == [DRAM] * 5
    # The keeper's first update: a snapshot of the hub from before it got our changes.
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    assert keeper.index.tiers(key_digests(k[:5])).tolist() == [DRAM] * 5  # kept
    hub.record(ours)
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    ssd = keeper.index.place_bit("node-a", 0)
    assert ssd == hub.index.place_bit("node-a", 0)
    assert keeper.index.tiers(key_digests(k[:5])).tolist() == [DRAM | ssd] * 5
    same(hub, keeper, k)
    # A remove made here and sent to the hub: the same end state either way.
    gone = IndexChange(OP_REMOVE, key_digests(k[:1]).astype("<u8").tobytes())
    keeper.apply_local([gone])
    hub.record([gone])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    same(hub, keeper, k)
    assert keeper.index.tiers(key_digests(k[:1])).tolist() == [ssd]


def test_a_hub_update_never_takes_back_a_newer_change_of_this_node():
    """Read your writes: a block removed, then stored again, here; the hub's next update
    carries only the remove (the store is still on its way): the index shows the store."""
    hub = IndexHub(4096)
    keeper = IndexKeeper(BlockIndex.create(4096))
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    k = keys(3)
    stored = change(OP_ADD, k)
    hub.record([stored])
    keeper.apply_local([stored])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    removed, again = change(OP_REMOVE, k[:1]), change(OP_ADD, k[:1])
    keeper.apply_local([removed])
    keeper.apply_local([again])
    hub.record([removed])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    assert keeper.index.tiers(key_digests(k)).tolist() == [DRAM] * 3
    hub.record([again])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    assert not keeper._unconfirmed  # every change came back
    same(hub, keeper, k)


def test_a_change_waiting_for_its_place_is_confirmed_by_the_update_that_names_it():
    """An SSD store made here before the hub named its place, and the hub's update that
    names it and carries it: confirmed there, so the tier's later eviction sticks (seen:
    the store replayed after every update, the evicted block's SSD bit back for good)."""
    hub = IndexHub(4096)
    keeper = IndexKeeper(BlockIndex.create(4096))
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    k = keys(2)
    stored = change(OP_ADD, k, "node-a", 0)
    keeper.apply_local([stored])  # waits: no bit for node-a's slot 0 yet
    hub.record([stored])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    bit = keeper.index.place_bit("node-a", 0)
    assert keeper.index.tiers(key_digests(k)).tolist() == [bit] * 2
    assert not keeper._unconfirmed
    evicted = change(OP_REMOVE, k[:1], "node-a", 0)
    keeper.apply_local([evicted])
    hub.record([evicted])
    keeper.apply(hub.since(keeper.epoch, keeper.seq))
    assert keeper.index.tiers(key_digests(k)).tolist()[1] == bit
    assert not keeper.index.tiers(key_digests(k[:1])).any() & bit
    same(hub, keeper, k)


def test_eviction_sweep_asks_about_the_oldest_keys_as_the_server_evicts() -> None:
    from kvray.store.index_publisher import SWEEP_BLIND, EvictionSweep

    sweep = EvictionSweep(kept=1000)
    sweep.stored([f"k{i}" for i in range(1200)])
    assert len(sweep) == 1000  # the oldest 200 are no longer reconciled
    assert sweep.due()[:2] == ["k200", "k201"] and len(sweep.due()) == SWEEP_BLIND
    sweep.seen_evicted = 10
    # The first counter seen counts from 0: these keys may be among the 10 it counts.
    assert len(sweep.due()) == 256
    assert sweep.due() == []  # it did not move
    sweep.seen_evicted = 110
    keys = sweep.due()
    assert len(keys) == 400 and keys[0] == "k200"  # 4 x what was evicted, oldest first
    present = [i % 2 == 0 for i in range(400)]
    gone = sweep.checked(keys, present)
    assert gone == keys[1::2] and sweep.found_gone == 200 and len(sweep) == 800
    sweep.seen_evicted = 111
    # Still there: moved to the back, so the next pass (at least 256) asks about others.
    assert sweep.due()[0] == "k600"
    sweep.dropped(["k600"])
    sweep.stored(["k601"])  # stored again: the newest
    sweep.seen_evicted = 112
    assert sweep.due()[:1] == ["k602"]


def test_eviction_sweep_asks_about_every_key_after_a_segment_went() -> None:
    from kvray.store.index_publisher import SWEEP_MAX, EvictionSweep

    sweep = EvictionSweep()
    n = 2 * SWEEP_MAX + 100
    sweep.stored([f"k{i}" for i in range(n)])
    sweep.seen_evicted = 0
    assert sweep.due() == []  # the eviction counter did not move
    assert sweep.ask_all() == n
    asked: list[str] = []
    while keys := sweep.due():
        present = [not k.endswith("7") for k in keys]  # the segment held these
        sweep.checked(keys, present)
        sweep.stored([f"new{len(asked)}"])  # stores go on meanwhile: not asked this time
        asked += keys
    assert sorted(asked) == sorted(f"k{i}" for i in range(n))  # each key once
    assert sweep.found_gone == sum(1 for i in range(n) if i % 10 == 7)
    sweep.seen_evicted = 1
    assert len(sweep.due()) == 256  # then back to following the eviction counter


def test_a_publisher_connects_to_its_keeper_when_asked_even_within_its_retry_pause(
    monkeypatch,
) -> None:
    """An embedded pool's first engine attaches its workers (their BackendClients, these
    publishers) before its scheduler makes the node's keeper: the keeper, asked for its
    index by the scheduler, has the node's clients connect to it (``connect``): found,
    and the first call made, so the first store's read-your-writes pays for neither
    (measured: up to 550 ms on a busy host, when a lookup waits 200 ms for a save in
    flight). A publisher that found no keeper looks again only after KEEPER_RETRY_S when
    it publishes, but at once when asked to connect."""
    from kvray.config import PoolConfig
    from kvray.store import index_publisher

    calls: list[list[IndexChange]] = []

    class Done:
        async def aresult(self, timeout_s: float) -> None:
            return None

    class NoChannel:
        async def aresult(self, timeout_s: float) -> None:
            raise KVRayError("no node channel here")

    class Keeper:
        name = "Lookup@node-1"

        def index_apply(self, changes: list[IndexChange]) -> Done:
            calls.append(changes)
            return Done()

        def channel(self) -> NoChannel:  # (its changes then go as these Ray calls)
            return NoChannel()

    found = iter([None, Keeper()])
    tries: list[str] = []

    def find(name: str, namespace: str) -> object:
        tries.append(name)
        return next(found)

    monkeypatch.setattr(index_publisher.remote, "find", find)
    monkeypatch.setattr(index_publisher, "LookupHandle", lambda actor, name: actor)
    pub = index_publisher.IndexPublisher(PoolConfig.from_dict({}, environ={}), "node-1", "t")
    asyncio.run(pub.publish([change(OP_ADD, keys(2))]))  # no keeper yet: the hub brings it
    assert len(tries) == 1 and pub._keeper is None and calls == []
    asyncio.run(pub.publish([change(OP_ADD, keys(2))]))  # within the pause: not looked for
    assert len(tries) == 1
    asyncio.run(pub.connect())  # asked: looked for at once, one empty call
    assert len(tries) == 2 and isinstance(pub._keeper, Keeper) and calls == [[]]
    asyncio.run(pub.publish([change(OP_ADD, keys(1))]))
    assert len(calls) == 2 and len(tries) == 2  # the next store goes straight to it


def test_a_publisher_hands_its_changes_over_the_keepers_node_channel_and_ray_when_it_broke(
    monkeypatch,
) -> None:
    """The keeper takes a store's changes on its node channel (no Ray round trip on the
    path of a lookup waiting for that store). When the channel breaks (the keeper
    restarted), the change goes as a Ray call, and the channel is asked for again after
    the retry pause."""
    from kvray.config import PoolConfig
    from kvray.store import index_publisher
    from kvray.store.channel import ChannelServer

    by_channel: list[list[IndexChange]] = []
    by_ray: list[list[IndexChange]] = []

    class Done:
        async def aresult(self, timeout_s: float) -> None:
            return None

    class Address:
        def __init__(self, address: str) -> None:
            self.address = address

        async def aresult(self, timeout_s: float) -> str:
            return self.address

    async def apply(changes: list[IndexChange]) -> None:
        by_channel.append(changes)

    class Keeper:
        name = "Lookup@node-1"
        server: ChannelServer | None = None

        def index_apply(self, changes: list[IndexChange]) -> Done:
            by_ray.append(changes)
            return Done()

        def channel(self) -> Address:
            assert self.server is not None
            return Address(self.server.address)

    keeper = Keeper()
    monkeypatch.setattr(index_publisher.remote, "find", lambda name, namespace: keeper)
    monkeypatch.setattr(index_publisher, "LookupHandle", lambda actor, name: actor)
    pub = index_publisher.IndexPublisher(PoolConfig.from_dict({}, environ={}), "node-1", "t")

    async def run() -> None:
        keeper.server = ChannelServer("test-keeper", {"index_apply": apply})
        await keeper.server.start()
        await pub.publish([change(OP_ADD, keys(2))])
        await pub.publish([change(OP_ADD, keys(1))])
        assert [len(c) for c in by_channel] == [1, 1] and by_ray == []
        await keeper.server.close()  # the keeper went away: its channel is closed
        await pub.publish([change(OP_ADD, keys(1))])
        assert len(by_channel) == 2 and len(by_ray) == 1
        await pub.publish([change(OP_ADD, keys(1))])  # within the pause: Ray again
        assert len(by_ray) == 2
        keeper.server = ChannelServer("test-keeper", {"index_apply": apply})
        await keeper.server.start()
        pub._link.ask_now()  # type: ignore[union-attr]  # the pause is over
        await pub.publish([change(OP_ADD, keys(1))])
        assert len(by_channel) == 3 and len(by_ray) == 2
        await keeper.server.close()

    asyncio.run(run())


class Publisher:
    """What an IndexPublisher makes: changes of ``node`` numbered by one source."""

    def __init__(self, node: str, source: str = "bc0") -> None:
        self.node, self.source, self.count = node, source, 0

    def __call__(self, op: int, ks: list[str]) -> IndexChange:
        self.count += 1
        raw = key_digests(ks).astype("<u8").tobytes()
        return IndexChange(op, raw, "", -1, self.node, self.source, self.count)


def test_a_keeper_gets_its_own_nodes_changes_as_markers_in_the_logs_order():
    """The hub sends a keeper its own node's changes as markers (no digests), in the log's
    order among the other nodes' changes: another node's remove recorded between two of
    ours ends as the hub's order says, and every pending change is taken off."""
    hub = IndexHub(4096)
    keeper = IndexKeeper(BlockIndex.create(4096))
    keeper.apply(hub.since(keeper.epoch, keeper.seq, "node-a"))
    ours, theirs = Publisher("node-a"), Publisher("node-b")
    k = keys(4)
    first, gone, again = ours(OP_ADD, k), theirs(OP_REMOVE, k[:2]), ours(OP_ADD, k[1:2])
    keeper.apply_local([first])
    hub.record([first, gone])
    keeper.apply_local([again])
    hub.record([again])
    update = hub.since(keeper.epoch, keeper.seq, "node-a")
    assert [len(raw) for _, _, raw, _, _ in update.changes] == [0, 16, 0]  # markers, theirs
    keeper.apply(update)
    same(hub, keeper, k)
    assert keeper.index.tiers(key_digests(k)).tolist() == [REMOVED, DRAM, DRAM, DRAM]
    assert not keeper._unconfirmed and keeper.lost == 0
    # the other node's keeper gets them all, whole
    other = IndexKeeper(BlockIndex.create(4096))
    other.apply(hub.since("", 0, "node-b"))  # a snapshot
    same(hub, other, k)


def test_a_long_poll_does_not_wake_for_the_keepers_own_nodes_changes():
    """Only another node's change (or the poll's limit) answers a keeper's long poll; at
    the limit the answer carries the markers, and the keeper's pending changes drain."""

    async def scenario() -> None:
        hub = IndexHub(4096)
        keeper = IndexKeeper(BlockIndex.create(4096))
        keeper.apply(await hub.wait("", 0, 0.01, "node-a"))
        ours, theirs = Publisher("node-a"), Publisher("node-b")
        waiting = asyncio.ensure_future(hub.wait(keeper.epoch, keeper.seq, 10, "node-a"))
        await asyncio.sleep(0.02)
        mine = ours(OP_ADD, keys(2))
        keeper.apply_local([mine])
        hub.record([mine])
        await asyncio.sleep(0.05)
        assert not waiting.done()  # its own node's change alone
        hub.record([theirs(OP_ADD, keys(2, 10))])
        update = await asyncio.wait_for(waiting, 1)
        assert [len(c[2]) for c in update.changes] == [0, 16]
        keeper.apply(update)
        assert not keeper._unconfirmed
        mine = ours(OP_ADD, keys(1, 20))
        keeper.apply_local([mine])
        hub.record([mine])
        update = await hub.wait(keeper.epoch, keeper.seq, 0.05, "node-a")  # the limit
        assert [len(c[2]) for c in update.changes] == [0]
        keeper.apply(update)
        assert not keeper._unconfirmed
        same(hub, keeper, keys(30))

    asyncio.run(scenario())


def test_a_marker_of_a_change_the_keeper_never_got_brings_the_changes_again_whole():
    """A change of this node that did not reach its keeper (the call failed): its marker
    makes the keeper ask again from the same position, for the changes whole (no
    snapshot), which have it."""
    hub = IndexHub(4096)
    keeper = IndexKeeper(BlockIndex.create(4096))
    keeper.apply(hub.since(keeper.epoch, keeper.seq, "node-a"))
    seq = keeper.seq
    missed = Publisher("node-a")(OP_ADD, keys(3))
    hub.record([missed])  # never applied here
    keeper.apply(hub.since(keeper.epoch, keeper.seq, "node-a"))
    assert keeper.lost == 1 and keeper.whole and keeper.seq == seq
    assert not keeper.index.tiers(key_digests(keys(3))).any()
    update = hub.since(keeper.epoch, keeper.seq, "" if keeper.whole else "node-a")
    assert update.snapshot is None and [len(c[2]) for c in update.changes] == [24]
    keeper.apply(update)
    assert not keeper.whole and keeper.snapshots == 1 and keeper.seq == hub.seq
    same(hub, keeper, keys(3))
    assert keeper.index.tiers(key_digests(keys(3))).tolist() == [DRAM] * 3
