"""The pool's KV events (kvray/index/kv_events.py): which blocks the catalog announces from the
index's tier masks (every column of the key space, per medium), and the publisher's
wire format, read by a subscriber built from vLLM's own ``vllm.distributed.kv_events``
types (as vLLM's examples/online_serving/kv_events_subscriber.py builds one): the
first batch of a topic, live batches, a replay from the buffer, and a snapshot for a
subscriber further behind than the buffer."""

from __future__ import annotations

import time

import pytest

from kvray.index.block_index import DRAM, BlockIndex, space_digests
from kvray.index.kv_events import CPU, STORAGE, BlockInfo, Described, GroupInfo, KVEventsHub
from kvray.keys import KeySpace, chain_block_hashes, geometry_digest
from tests.kv_subscriber import Subscriber, ext, vk

SPACE = KeySpace("events-test", "float32-b16-h2x64", tp_size=2)
TOPIC = "kv@127.0.0.1@tiny"


def _blocks(n: int, seed: int = 0) -> list[BlockInfo]:
    tokens = [list(range(seed * 1000 + 16 * i, seed * 1000 + 16 * (i + 1))) for i in range(n)]
    hashes = chain_block_hashes([t for b in tokens for t in b], 16)
    return [
        BlockInfo(h, hashes[i - 1] if i else None, tuple(tokens[i])) for i, h in enumerate(hashes)
    ]


@pytest.fixture
def index():
    ix = BlockIndex.create(4096)
    yield ix
    ix.close()


@pytest.fixture
def hub(index):
    h = KVEventsHub(
        index,
        "pool-a",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        buffer=4,
        hwm=1000,
        max_blocks=100,
        node_name=lambda node_id: f"node-{node_id}",
    )
    h.publisher.wait_ready(120)
    yield h
    h.close()


def _store(index: BlockIndex, blocks: list[BlockInfo], columns: list[int], bits: int = DRAM):
    d = space_digests(SPACE, [b.block_hash for b in blocks])[columns].ravel()
    index.add(d, bits)
    return d


def test_a_block_is_announced_once_every_column_holds_it_and_removed_when_one_goes(index):
    from kvray.index.kv_events import BlockCatalog

    cat = BlockCatalog(index, "pool-a", lambda bit: "n1", max_blocks=100)
    blocks = _blocks(3)
    topics, events = cat.describe(Described(SPACE, TOPIC, 16, tuple(blocks)))
    assert topics == [TOPIC] and events == []  # nothing stored yet

    d0 = _store(index, blocks, [0])
    assert cat.changed([d0]) == []  # rank 0's column only: not a hit for the instance
    d1 = _store(index, blocks, [1])
    (topic, ev), *rest = cat.changed([d1])
    assert rest == [] and topic == TOPIC
    assert (ev.kind, ev.medium, ev.ownership) == ("stored", CPU, "pool-a")
    assert [b.block_hash for b in ev.blocks] == [b.block_hash for b in blocks]

    gone = space_digests(SPACE, [blocks[2].block_hash])[1]
    index.remove(gone, DRAM)
    ((_, ev),) = cat.changed([gone])
    assert (ev.kind, ev.medium) == ("removed", CPU)
    assert [b.block_hash for b in ev.blocks] == [blocks[2].block_hash]

    bit = index.place_bit("nodeA", 0)
    ssd = _store(index, blocks[:1], [0, 1], bit)
    ((_, ev),) = cat.changed([ssd])
    assert (ev.kind, ev.medium, ev.ownership) == ("stored", STORAGE, "pool-a@n1")

    snap = cat.snapshot(TOPIC)
    assert snap[0].kind == "cleared"
    held = {(e.medium, b.block_hash) for e in snap[1:] for b in e.blocks}
    assert held == {(CPU, blocks[0].block_hash), (CPU, blocks[1].block_hash)} | {
        (STORAGE, blocks[0].block_hash)
    }


def test_a_block_stored_before_it_was_described_is_announced_by_the_description(index):
    from kvray.index.kv_events import BlockCatalog

    cat = BlockCatalog(index, "pool-a", lambda bit: "n1", max_blocks=100)
    blocks = _blocks(2)
    _store(index, blocks, [0, 1])
    _, events = cat.describe(Described(SPACE, TOPIC, 16, tuple(blocks)))
    assert [(t, e.kind, len(e.blocks)) for t, e in events] == [(TOPIC, "stored", 2)]


def test_a_second_key_space_on_a_topic_is_refused_and_past_max_blocks_the_oldest_go(index):
    from kvray.index.kv_events import BlockCatalog

    cat = BlockCatalog(index, "pool-a", lambda bit: "n1", max_blocks=3)
    blocks = _blocks(3)
    _store(index, blocks, [0, 1])
    cat.describe(Described(SPACE, TOPIC, 16, tuple(blocks)))
    other = KeySpace("events-test", "float32-b16-h2x64", tp_size=1)
    topics, _ = cat.describe(Described(other, TOPIC, 16, tuple(_blocks(1, seed=5))))
    assert topics == [] and cat.refused_topics == {TOPIC}
    assert cat.blocks == 3  # a key space no topic carries keeps nothing

    more = _blocks(1, seed=9)
    _, events = cat.describe(Described(SPACE, TOPIC, 16, tuple(more)))
    removed = [b.block_hash for _, e in events if e.kind == "removed" for b in e.blocks]
    assert removed == [blocks[0].block_hash]  # forgotten first, published removed
    assert cat.blocks == 3


def test_a_subscriber_with_vllms_types_sees_a_snapshot_then_live_batches_and_replays(hub, index):
    sub = Subscriber(hub.publisher.endpoint, hub.publisher.replay_endpoint, TOPIC)
    try:
        first = _blocks(2)
        _store(index, first, [0, 1])
        time.sleep(0.3)  # a PUB drops what it sends before the subscription reached it
        hub.describe([Described(SPACE, TOPIC, 16, tuple(first))])
        topic, seq, batch = sub.recv()
        assert (topic, seq) == (TOPIC, 0)
        assert isinstance(batch.events[0], vk.AllBlocksCleared)  # a topic starts cleared
        sub.apply(batch)
        assert sub.blocks[(CPU, "pool-a")] == {ext(b.block_hash) for b in first}
        stored = [e for e in batch.events if isinstance(e, vk.BlockStored)]
        assert stored[0].token_ids == [t for b in first for t in b.token_ids]
        assert stored[0].parent_block_hash is None and stored[0].block_size == 16

        second = _blocks(2, seed=1)
        hub.describe([Described(SPACE, TOPIC, 16, tuple(second))])
        hub.changed([_store(index, second, [0, 1])])
        seqs = []
        for _ in range(2):  # the description's topic is known: no batch for it alone
            try:
                _, seq, batch = sub.recv(timeout_s=2)
            except TimeoutError:
                break
            seqs.append(seq)
            sub.apply(batch)
        assert seqs == [1]
        assert sub.blocks[(CPU, "pool-a")] == {ext(b.block_hash) for b in first + second}

        # A replay from the buffer: the same batches, then the end marker.
        replayed = sub.replay(0)
        assert [(t, s) for t, s, _ in replayed] == [(TOPIC, 0), (TOPIC, 1)]

        # Past the buffer (4 batches): a subscriber asking from 0 gets the snapshot.
        for i in range(5):
            more = _blocks(1, seed=10 + i)
            hub.describe([Described(SPACE, TOPIC, 16, tuple(more))])
            hub.changed([_store(index, more, [0, 1])])
        deadline = time.monotonic() + 10
        while hub.publisher.published < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        (topic, seq, snap), *rest = sub.replay(0)
        assert rest == [] and seq == 6
        fresh = Subscriber(hub.publisher.endpoint, None, TOPIC)
        fresh.apply(snap)
        assert fresh.blocks[(CPU, "pool-a")] == {ext(b.block_hash) for b in first + second} | {
            ext(_blocks(1, seed=10 + i)[0].block_hash) for i in range(5)
        }
        fresh.close()
    finally:
        sub.close()


def test_block_hashes_are_published_as_vllm_publishes_them(hub, index):
    """vLLM's events carry the block hash bytes, or with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    its last 8 bytes as an integer: the pool's carry them the same way."""
    blocks = _blocks(1, seed=42)
    sub = Subscriber(hub.publisher.endpoint, None, TOPIC)
    try:
        time.sleep(0.3)
        _store(index, blocks, [0, 1])
        hub.describe([Described(SPACE, TOPIC, 16, tuple(blocks))])
        _, _, batch = sub.recv()
        (stored,) = [e for e in batch.events if isinstance(e, vk.BlockStored)]
        assert stored.block_hashes == [ext(blocks[0].block_hash)]
    finally:
        sub.close()


def test_the_keys_of_announced_blocks_are_every_columns_key_and_digest(index):
    """What the manager asks the backend about after a node loss: each column's key
    string of the blocks announced in a medium, with the digest the index holds."""
    from kvray.index.block_index import key_digests
    from kvray.index.kv_events import BlockCatalog

    cat = BlockCatalog(index, "pool-a", lambda bit: "n1", max_blocks=100)
    blocks = _blocks(3)
    cat.describe(Described(SPACE, TOPIC, 16, tuple(blocks)))
    d = _store(index, blocks[:2], [0, 1])
    cat.changed([d])
    digests, keys = cat.keys_in(CPU)
    hashes = [b.block_hash for b in blocks[:2]]
    want = {k for r in range(2) for k in SPACE.rank_key_strs(hashes, r)}
    assert set(keys) == want and len(keys) == 4
    assert digests.tolist() == key_digests(keys).tolist()  # in the same order
    assert cat.keys_in(STORAGE)[1] == []


HYBRID = KeySpace(
    "events-test",
    "float32-b16-h2x64",
    tp_size=2,
    geometries=(geometry_digest("p2x16x64", ["attn"]), geometry_digest("state", ["ssm"])) * 2,
    kv_groups=2,
    state_groups=(1,),
)
"""A hybrid model's key space: group 0 full attention, group 1 a state group."""
GROUPS = (GroupInfo("full_attention"), GroupInfo("mamba"))


def _columns(space: KeySpace, group: int) -> list[int]:
    return [c for c in range(space.columns) if space.column(c)[2] == group]


def test_each_kv_cache_group_is_announced_on_its_own_with_vllms_group_fields(hub, index):
    """A hybrid model's blocks: group 0's once every rank stored it, group 1's (a state
    group) only at the blocks whose state was saved; each event names its group, kind and
    window as vLLM's own do, so a subscriber with vLLM's types reads them apart."""
    from kvray.index.kv_events import BlockCatalog

    cat = BlockCatalog(index, "pool-a", lambda bit: "n1", max_blocks=100)
    blocks = _blocks(4, seed=3)
    hashes = [b.block_hash for b in blocks]
    digs = space_digests(HYBRID, hashes)
    index.add(digs[_columns(HYBRID, 0)].ravel(), DRAM)  # attention: every block, both ranks
    index.add(digs[_columns(HYBRID, 1)][:, [1, 3]].ravel(), DRAM)  # states at blocks 1 and 3
    _, events = cat.describe(Described(HYBRID, TOPIC, 16, tuple(blocks), GROUPS))
    got = [(e.group, e.group_info.kind, [hashes.index(b.block_hash) for b in e.blocks])
           for _, e in events]  # fmt: skip
    assert got == [(0, "full_attention", [0, 1, 2, 3]), (1, "mamba", [1, 3])]
    snap = cat.snapshot(TOPIC)
    assert [(e.kind, e.group, len(e.blocks)) for e in snap] == [
        ("cleared", 0, 0), ("stored", 0, 4), ("stored", 1, 2)]  # fmt: skip

    # A state removed: group 1's block 3 only.
    gone = digs[_columns(HYBRID, 1)][:, 3]
    index.remove(gone, DRAM)
    ((_, ev),) = cat.changed([gone])
    assert (ev.kind, ev.group, [b.block_hash for b in ev.blocks]) == ("removed", 1, [hashes[3]])

    # On the wire: vLLM's BlockStored / BlockRemoved with group_idx and the spec's kind.
    sub = Subscriber(hub.publisher.endpoint, None, TOPIC)
    try:
        time.sleep(0.3)
        hub.describe([Described(HYBRID, TOPIC, 16, tuple(blocks), GROUPS)])
        _, _, batch = sub.recv()
        stored = [(e.group_idx, e.kv_cache_spec_kind, len(e.block_hashes))
                  for e in batch.events if isinstance(e, vk.BlockStored)]  # fmt: skip
        assert stored == [(0, "full_attention", 4), (1, "mamba", 1)]
        index.remove(digs[_columns(HYBRID, 0)][:, 0], DRAM)
        hub.changed([digs[_columns(HYBRID, 0)][:, 0]])
        _, _, batch = sub.recv()
        (removed,) = batch.events
        assert isinstance(removed, vk.BlockRemoved) and removed.group_idx == 0
    finally:
        sub.close()


def test_an_engine_that_reset_its_blocks_starts_its_topic_over(index):
    """A reset moves the engine's keys to a new generation: its topic gets
    ``AllBlocksCleared`` and from then on the new generation's blocks, where another key
    space on the topic would be refused."""
    from dataclasses import replace

    from kvray.index.kv_events import BlockCatalog

    geo = (geometry_digest("p2x16x64", ["a"]), geometry_digest("p2x16x64", ["b"]))
    old = KeySpace("events-test", "float32-b16-h2x64", tp_size=2, geometries=geo)
    new = replace(old, generation=1)
    cat = BlockCatalog(index, "pool-a", lambda bit: "n1", max_blocks=100)
    blocks = _blocks(2, seed=7)
    index.add(space_digests(old, [b.block_hash for b in blocks]).ravel(), DRAM)
    cat.describe(Described(old, TOPIC, 16, tuple(blocks)))
    assert len(cat.snapshot(TOPIC)) == 2  # cleared, the 2 blocks
    index.add(space_digests(new, [blocks[0].block_hash]).ravel(), DRAM)
    topics, events = cat.describe(Described(new, TOPIC, 16, tuple(blocks[:1])))
    assert topics == [] and not cat.refused_topics
    assert [(e.kind, len(e.blocks)) for _, e in events] == [("cleared", 0), ("stored", 1)]
    assert [b.block_hash for e in cat.snapshot(TOPIC)[1:] for b in e.blocks] == [
        blocks[0].block_hash
    ]
