"""The proxy's prefix router (kvray/proxy/router.py, kvray/proxy/feeds.py): blocks matched by
their tokens from vLLM's KV events, instances scored by their own cache and the pool's,
the load-imbalance bound, and the subscriptions fed by vLLM's own ZMQ publisher (a gap
replayed from its replay socket)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from kvray.proxy.router import (
    POOL_CPU,
    POOL_STORAGE,
    CacheView,
    GroupKind,
    PrefixRouter,
    block_keys,
)

BS = 4


def tokens(n_blocks: int, first: int = 100) -> list[int]:
    return list(range(first, first + n_blocks * BS))


def store(view: CacheView, toks: list[int], *, parent=None, first_hash: int = 0,
          where=("GPU", None), salt=None) -> list[int]:  # fmt: skip
    """As an engine's BlockStored: hashes of its own (any values), tokens, extra keys."""
    n = len(toks) // BS
    hashes = [first_hash + i for i in range(n)]
    extra = [(salt,) if salt and i == 0 and parent is None else None for i in range(n)]
    view.stored(hashes, parent, toks, BS, extra, where)
    return hashes


@dataclass
class Inst:
    host: str
    view: CacheView | None
    in_flight: int = 0
    healthy: bool = True


def test_a_prompts_blocks_match_what_events_described_across_batches():
    view = CacheView("a")
    toks = tokens(5)
    first = store(view, toks[: 3 * BS], first_hash=10)
    store(view, toks[3 * BS :], parent=first[-1], first_hash=20)  # a later step's blocks
    keys = block_keys(toks + [1, 2], BS)  # a partial last block is never a key
    assert len(keys) == 5
    assert view.leading(keys, lambda w: True) == 5
    assert view.leading(block_keys([7] + toks[1:], BS), lambda w: True) == 0  # 1st token differs
    other = block_keys(toks[: 2 * BS] + [0] * BS, BS)
    assert view.leading(other, lambda w: True) == 2


def test_the_cache_salt_is_the_first_blocks_extra_key():
    view = CacheView("a")
    toks = tokens(2)
    store(view, toks, salt="tenant-1")
    assert view.leading(block_keys(toks, BS, "tenant-1"), lambda w: True) == 2
    assert view.leading(block_keys(toks, BS), lambda w: True) == 0
    assert view.leading(block_keys(toks, BS, "tenant-2"), lambda w: True) == 0


def test_removed_and_cleared_blocks_no_longer_count_and_children_still_resolve():
    view = CacheView("a")
    toks = tokens(3)
    hashes = store(view, toks[: 2 * BS])
    view.removed([hashes[1]], ("GPU", None))
    keys = block_keys(toks, BS)
    assert view.leading(keys, lambda w: True) == 1
    store(view, toks[2 * BS :], parent=hashes[1], first_hash=50)  # parent evicted before
    assert view.holds(keys[2], lambda w: True) and view.unresolved == 0
    view.cleared()
    assert view.leading(keys, lambda w: True) == 0
    store(view, toks[:BS], parent=12345)  # a parent never heard of: skipped, counted
    assert view.unresolved == 1


def test_a_block_in_two_media_stays_until_removed_from_both():
    pool = CacheView("pool")
    toks = tokens(1)
    (h,) = store(pool, toks, where=(POOL_CPU, "p"))
    store(pool, toks, where=(POOL_STORAGE, "p@10.0.0.1"))
    pool.removed([h], (POOL_CPU, "p"))
    key = block_keys(toks, BS)
    assert pool.leading(key, lambda w: True) == 1
    assert pool.leading(key, lambda w: w[0] == POOL_CPU) == 0


def test_the_instance_holding_the_prefix_wins_then_the_pools_hits_count_for_all():
    a, b = Inst("10.0.0.1", CacheView("a")), Inst("10.0.0.2", CacheView("b"))
    pool = CacheView("pool")
    router = PrefixRouter([a, b], pool, load_cost=0.2)
    toks = tokens(8)
    store(b.view, toks[: 6 * BS])
    choice = router.choose(toks)
    assert (choice.index, choice.local, choice.cached) == (1, 6, 6)
    # The pool holds all 8: a loads 8, b reuses 6 and loads 2 (cheaper).
    store(pool, toks, where=(POOL_CPU, "p"))
    choice = router.choose(toks)
    assert (choice.index, choice.local, choice.cached) == (1, 6, 8)
    assert choice.scores[0][:2] == (0, 8)
    assert choice.cost == pytest.approx(0.2 * 2)


def test_an_ssd_tier_counts_only_for_the_instances_on_its_node():
    a, b = Inst("10.0.0.1", CacheView("a")), Inst("10.0.0.2", CacheView("b"))
    pool = CacheView("pool")
    router = PrefixRouter([a, b], pool)
    toks = tokens(4)
    store(pool, toks, where=(POOL_STORAGE, "mypool@10.0.0.2"))
    assert [s[1] for s in router.choose(toks).scores] == [0, 4]
    assert router.choose(toks).index == 1


def test_the_imbalance_bound_sends_the_prefix_elsewhere_once_its_holder_is_busy():
    a, b = Inst("h", CacheView("a")), Inst("h", CacheView("b"))
    router = PrefixRouter([a, b], max_imbalance=2)
    toks = tokens(4)
    store(a.view, toks)
    picks = []
    for _ in range(5):  # requests that stay in flight
        choice = router.choose(toks)
        picks.append(choice.index)
        (a if choice.index == 0 else b).in_flight += 1
    # a while it has at most 2 more in flight than b (0, 1, 2), then b (a has 3), then a
    # again (3 - 1 = 2)
    assert picks == [0, 0, 0, 1, 0]
    assert router.bounded == 1
    assert (a.in_flight, b.in_flight) == (4, 1)
    assert router.choose(toks).index == 1
    assert PrefixRouter([a, b], max_imbalance=0).choose(toks).index == 1
    b.in_flight = 4
    assert PrefixRouter([a, b], max_imbalance=0).choose(toks).index == 0  # a tie: the cache


def test_with_nothing_known_requests_go_round_robin_to_the_least_busy():
    a, b = Inst("h", CacheView("a")), Inst("h", CacheView("b"))
    router = PrefixRouter([a, b])
    assert [router.choose(tokens(2)).index for _ in range(4)] == [0, 1, 0, 1]
    a.in_flight = 1
    assert router.choose(None).index == 1
    b.healthy = False
    assert router.choose(None).index == 0


def test_bad_router_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="max_imbalance -1"):
        PrefixRouter([], max_imbalance=-1)
    with pytest.raises(ValueError, match="between 0 and 1"):
        PrefixRouter([], load_cost=2)


def _wait(pred, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_feeds_from_vllms_own_publisher_replay_a_missed_batch():
    """vLLM's ZmqEventPublisher connects to the router's bound SUB socket; a batch it sent
    before the router listened is fetched from its replay socket."""
    vk = pytest.importorskip("vllm.distributed.kv_events")
    from kvray.proxy.feeds import EventFeeds
    from kvray.servers.process import free_port

    bind, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    topic = "kv@a@m"
    view = CacheView(topic)
    toks = tokens(4)

    def batch(hashes, parent, part):
        ev = vk.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=part,
                            block_size=BS, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
        return vk.KVEventBatch(ts=time.time(), events=[ev])

    pub = vk.ZmqEventPublisher(0, endpoint=bind, replay_endpoint=replay, topic=topic)
    feeds = EventFeeds(threading.Lock(), bind=bind, engines={topic: view},
                       engine_replays={topic: replay})  # fmt: skip
    try:
        pub.publish(batch([1, 2], None, toks[: 2 * BS]))  # nobody listens yet: lost
        time.sleep(0.5)
        feeds.start()
        time.sleep(0.5)  # the publisher's reconnect
        pub.publish(batch([3, 4], 2, toks[2 * BS :]))
        _wait(lambda: len(view) == 4)
        assert view.leading(block_keys(toks, BS), lambda w: True) == 4
        # the gap's replay brought both batches (the second was in its buffer already)
        assert feeds.stats.gaps == 1 and feeds.stats.replayed >= 1
        assert feeds.stats.replayed + feeds.stats.batches == 2
        assert feeds.stats.unknown_topics == 0
    finally:
        feeds.stop()
        pub.shutdown()


def test_feeds_ask_a_listening_pool_for_what_it_holds_at_once(tmp_path):
    """A publisher that listens (as the pool's does; vLLM's own here, on an ipc socket):
    the router connects, replays from the start before any new batch, and keeps only the
    topics of ``pool_topic``."""
    vk = pytest.importorskip("vllm.distributed.kv_events")
    from kvray.proxy.feeds import EventFeeds
    from kvray.servers.process import free_port

    endpoint, replay = f"ipc://{tmp_path}/pool.sock", f"tcp://127.0.0.1:{free_port()}"
    toks = tokens(2)
    ev = vk.BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=toks,
                        block_size=BS, lora_id=None, medium=POOL_CPU, lora_name=None)  # fmt: skip
    mine = vk.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="kv@h@m")
    pool = CacheView("pool")
    feeds = EventFeeds(threading.Lock(), pool=pool, pool_endpoint=endpoint, pool_replay=replay,
                       pool_topic="kv@")  # fmt: skip
    try:
        mine.publish(vk.KVEventBatch(ts=time.time(), events=[ev]))  # before the router
        time.sleep(0.5)
        feeds.start()
        _wait(lambda: len(pool) == 2)
        assert feeds.stats.replayed == 1 and feeds.stats.batches == 0
        assert pool.leading(block_keys(toks, BS), lambda w: w[0] == POOL_CPU) == 2
        more = tokens(1, first=900)
        child = vk.BlockStored(block_hashes=[9], parent_block_hash=8, token_ids=more,
                               block_size=BS, lora_id=None, medium=POOL_CPU,
                               lora_name=None)  # fmt: skip
        mine.publish(vk.KVEventBatch(ts=time.time(), events=[child]))  # live
        _wait(lambda: len(pool) == 3)
        assert pool.leading(block_keys(toks + more, BS), lambda w: True) == 3
        assert feeds.stats.batches == 1 and feeds.stats.decode_errors == 0
    finally:
        feeds.stop()
        mine.shutdown()


def test_a_hybrid_prefix_counts_only_as_far_as_every_group_can_serve_it():
    """vLLM's fixed point over KV cache groups: full attention needs every block before
    the hit's end, a sliding window (8 tokens: cdiv(7, 4) = 2 blocks) the blocks ending
    there, a state group the block that ends there. A state only at block 5 with
    attention up to block 3 is a hit of 0, not 3."""
    toks = tokens(8)
    keys = block_keys(toks, BS)
    full, window, state = (
        GroupKind("full_attention"),
        GroupKind("sliding_window", 8),
        GroupKind("mamba"),
    )
    hashes = list(range(8))

    def view_with(parts):
        v = CacheView("pool")
        for g, kind, blocks in parts:
            v.stored(hashes, None, toks, BS, None, (POOL_CPU, "p"), g, kind)  # learn the chain
            v.removed([h for h in hashes if h not in blocks], (POOL_CPU, "p"), g)
        return v

    v = view_with([(0, full, range(6)), (1, state, [2, 5])])
    assert v.leading(keys, lambda w: True) == 6  # attention to 6, the state at block 5
    v = view_with([(0, full, range(4)), (1, state, [5])])
    assert v.leading(keys, lambda w: True) == 0
    v = view_with([(0, full, range(4)), (1, state, [1, 5])])
    assert v.leading(keys, lambda w: True) == 2
    # A window of 2 blocks: blocks 4-5 held (0-3 left the engine's window) serve 6.
    v = view_with([(0, full, range(8)), (1, window, [4, 5])])
    assert v.leading(keys, lambda w: True) == 6


def test_an_engine_views_groups_take_the_pools_kinds_and_the_pool_completes_its_hit():
    """vLLM's engine events name the group but not its kind: the router takes the pool's
    word for the same group index. The engine holds attention for 6 blocks and the state
    at block 2; the pool holds the state at block 5: the instance serves 3 blocks alone,
    6 with the pool's help."""
    toks = tokens(6)
    hashes = list(range(6))
    engine = CacheView("a")
    engine.stored(hashes, None, toks, BS, None, ("GPU", None), 0)
    engine.stored(hashes, None, toks, BS, None, ("GPU", None), 1)
    engine.removed([h for h in hashes if h != 2], ("GPU", None), 1)
    pool = CacheView("pool")
    pool.stored(hashes, None, toks, BS, None, (POOL_CPU, "p"), 0, GroupKind("full_attention"))
    pool.stored(hashes, None, toks, BS, None, (POOL_CPU, "p"), 1, GroupKind("mamba"))
    pool.removed([h for h in hashes if h != 5], (POOL_CPU, "p"), 1)
    router = PrefixRouter([Inst("h", engine)], pool)
    choice = router.choose(toks)
    assert (choice.local, choice.cached) == (3, 6)
