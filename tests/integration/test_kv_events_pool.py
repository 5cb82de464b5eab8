"""The pool's KV events on a real pool (real Ray, a real mooncake_master and clients,
``kv_events`` on): blocks described as a scheduler describes them are published stored
once every rank's column is in the pool, and removed when kvray removes one or the
backend loses one (another client removes it behind kvray's back, as an eviction
would); a subscriber built from vLLM's types holds, after quiescence plus 2 s, exactly
the described blocks ``exists()`` shows whole; one that starts late rebuilds the same
set from a replay; and a pool without vLLM's index or with a taken port says so."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest

from kvray import Pool
from kvray.errors import ConfigError
from kvray.index.kv_events import BlockInfo, Described
from kvray.keys import KeySpace, KVLayout, chain_block_hashes

from .conftest import small_config

pytestmark = pytest.mark.integration
kv = pytest.importorskip("tests.kv_subscriber")
LAYOUT = KVLayout("float16", 16, 2, 64).tag()
TOPIC = "kv@127.0.0.1@int"


def _chain(n: int) -> tuple[list[bytes], tuple[BlockInfo, ...]]:
    """``n`` chained blocks of 16 tokens: their hashes, and as a scheduler describes them."""
    tokens = list(range(16 * n))
    hashes = chain_block_hashes(tokens, 16)
    infos = tuple(
        BlockInfo(h, hashes[i - 1] if i else None, tuple(tokens[16 * i : 16 * (i + 1)]))
        for i, h in enumerate(hashes)
    )
    return hashes, infos


def _whole(pool: Pool, space: KeySpace, hashes: list[bytes]) -> set:  # type: ignore[type-arg]
    """The blocks of ``hashes`` every column of which ``exists()`` (vLLM's hash form)."""
    present = [pool.exists(space.rank_key_strs(hashes, r), rank=r) for r in range(space.world_size)]
    return {kv.ext(h) for i, h in enumerate(hashes) if all(p[i] for p in present)}


def _settle(sub, pool: str, want: set, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Until the subscriber's DRAM blocks (ownership ``pool``) are ``want``."""
    deadline = time.monotonic() + timeout_s
    while (held := sub.blocks.get(("CPU", pool), set())) != want:
        assert time.monotonic() < deadline, f"the subscriber holds {held}, not {want}"
        sub.drain(0.2)


def test_events_match_the_pool_through_stores_removes_and_a_lost_block(
    ray_cluster, mooncake_master
):
    from kvray.backends import make_backend

    cfg = small_config(
        mooncake_master.address,
        lookup_index=True,
        kv_events={"host": "loopback", "port": 0, "replay_port": 0},
    )
    space = KeySpace(cfg.name, LAYOUT, tp_size=2)
    hashes, infos = _chain(5)
    block = np.arange(4096, dtype=np.uint8)
    with Pool.start(cfg) as pool:
        ends = pool.kv_events()
        assert ends is not None
        sub = kv.Subscriber(ends["endpoint"], ends["replay"], TOPIC)
        try:
            time.sleep(0.3)  # (a PUB drops what it sends before a subscription reaches it)
            pool._h.manager.describe_blocks([Described(space, TOPIC, 16, infos)]).result(30)
            pool.put(space.rank_key_strs(hashes, 0), [block] * 5, rank=0)
            pool.put(space.rank_key_strs(hashes[:4], 1), [block] * 4, rank=1)
            _settle(sub, cfg.name, {kv.ext(h) for h in hashes[:4]})  # rank 1 lacks the 5th

            stored = [e for e in sub.events if isinstance(e, kv.vk.BlockStored)]
            assert stored[0].token_ids[:16] == list(range(16))
            assert stored[0].parent_block_hash is None and stored[0].block_size == 16
            assert {e.medium for e in stored} == {"CPU"} and {e.ownership for e in stored} == {
                cfg.name
            }

            pool.remove(space.rank_key_strs(hashes[1:2], 1), rank=1, force=True)

            async def lose() -> None:  # another client removes a key: as an eviction would
                raw = make_backend(cfg, pool.server_address, contribute_memory=False)
                try:
                    await raw.remove(space.rank_key_strs(hashes[2:3], 0), force=True)
                finally:
                    await raw.close()

            asyncio.run(lose())
            _settle(sub, cfg.name, {kv.ext(h) for h in (hashes[0], hashes[3])})
            time.sleep(2)  # quiescence plus 2 s: what the subscriber holds is the pool's
            sub.drain(0.5)
            assert sub.blocks[("CPU", cfg.name)] == _whole(pool, space, hashes)

            late = kv.Subscriber(ends["endpoint"], ends["replay"], TOPIC)
            try:
                for _, _, batch in late.replay(0):
                    late.apply(batch)
                assert late.blocks[("CPU", cfg.name)] == _whole(pool, space, hashes)
            finally:
                late.close()
        finally:
            sub.close()
        pool.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("events", [True, False], ids=["kv_events", "index_only"])
def test_a_live_clients_segment_the_master_dropped_leaves_the_index(ray_cluster, events):
    """A BackendClient stalled past the master's ``client_ttl`` (SIGSTOP, as a process
    starved on a busy host): the embedded master drops it with its segment, and the
    blocks stored there; resumed, it mounts its segment again, empty. Nothing was
    evicted, so only the manager's reading of the master's segments can tell. The pool's
    block index ends with the other client's blocks, exactly what exists() shows, and so
    does a KV-events subscriber (with ``kv_events``; without, the clients' sweeps alone
    find the gone blocks)."""
    extra = {"kv_events": {"host": "loopback", "port": 0, "replay_port": 0}} if events else {}
    cfg = small_config(None, lookup_index=True, **extra)
    space = KeySpace(cfg.name, LAYOUT)
    hashes, infos = _chain(6)
    block = np.arange(4096, dtype=np.uint8)
    kept = {kv.ext(h) for h in hashes[:3]}
    with Pool.start(cfg) as pool:
        ends = pool.kv_events() if events else None
        sub = kv.Subscriber(ends["endpoint"], ends["replay"], TOPIC) if ends else None
        stalled = psutil.Process(pool._h.client(1).probe().result(30)["pid"])
        try:
            time.sleep(0.3)  # (a PUB drops what it sends before a subscription reaches it)
            if sub is not None:
                pool._h.manager.describe_blocks([Described(space, TOPIC, 16, infos)]).result(30)
            keys = space.rank_key_strs(hashes, 0)
            pool.put(keys[:3], [block] * 3, rank=0)  # each client puts in its own segment
            pool.put(keys[3:], [block] * 3, rank=1)
            if sub is not None:
                _settle(sub, cfg.name, {kv.ext(h) for h in hashes})
            deadline = time.monotonic() + 30
            while pool.prefix_match(space, hashes).dram != 6:  # the hub has both clients'
                assert time.monotonic() < deadline, "the index never showed the 6 blocks"
                time.sleep(0.2)

            def capacity() -> float:
                metrics = pool._h.manager.server_metrics().result(30)
                return metrics.get("master_total_capacity_bytes", 0.0)

            deadline = time.monotonic() + 30
            while capacity() < 2 * (64 << 20):  # until the manager has read both segments
                assert time.monotonic() < deadline, "the master never showed two segments"
                time.sleep(0.2)
            stalled.suspend()
            try:
                while capacity() >= 2 * (64 << 20):  # the master dropped the stalled client
                    assert time.monotonic() < deadline + 30, "the master kept the segment"
                    time.sleep(0.2)
            finally:
                stalled.resume()

            def leading(held: set) -> int:  # type: ignore[type-arg]
                return next((i for i, h in enumerate(hashes) if kv.ext(h) not in held), 6)

            def shown() -> tuple[int, set]:  # type: ignore[type-arg]
                if sub is not None:
                    sub.drain(0.2)
                return pool.prefix_match(space, hashes).dram, (
                    sub.blocks.get(("CPU", cfg.name), set()) if sub is not None else set()
                )

            # Until the index (and the subscriber) show what exists() shows. (On a busy
            # host the master may drop the other client too, for a while: the index must
            # follow that as well.)
            deadline = time.monotonic() + 60
            while True:
                whole = _whole(pool, space, hashes)
                if shown() == (leading(whole), whole if sub is not None else set()):
                    break
                assert time.monotonic() < deadline, f"the pool holds {whole}; shown {shown()}"
                time.sleep(0.5)
            time.sleep(2)  # quiescence plus 2 s
            whole = _whole(pool, space, hashes)
            assert whole <= kept, "the stalled client's blocks outlived its segment"
            assert shown() == (leading(whole), whole if sub is not None else set())
        finally:
            if sub is not None:
                sub.close()
        pool.shutdown()


def test_kv_events_need_the_index_and_a_free_port(ray_cluster, mooncake_master):
    with pytest.raises(ConfigError, match="lookup_index: true"):
        small_config(mooncake_master.address, lookup_index=False, kv_events={})
    free = {"port": 0, "replay_port": 0}
    cfg = small_config(mooncake_master.address, lookup_index=True, kv_events=free)
    with Pool.start(cfg) as pool:
        taken = pool.kv_events()
        assert taken is not None
        port = int(taken["endpoint"].rsplit(":", 1)[1])
        clash = small_config(
            mooncake_master.address, lookup_index=True, kv_events={**free, "port": port}
        )
        with pytest.raises(Exception, match=f"kv_events cannot listen on tcp://127.0.0.1:{port}"):
            Pool.start(clash)
        pool.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("traffic", [True, False], ids=["traffic", "idle"])
def test_events_follow_the_masters_own_evictions(ray_cluster, traffic):
    """A pool whose DRAM tier (32 MB) is filled past its eviction watermark (70 %) by
    described blocks: the master evicts some on its own; the client learns it from its
    eviction counter, carried by later traffic of blocks no scheduler described, or, idle,
    by asking the manager for it, and reconciles, and the subscriber ends with exactly
    what exists() shows.

    Nothing asks the master about the described blocks until an eviction is published:
    Mooncake's ``exists`` grants a read lease, and a leased object is not evicted."""
    from kvray.config import PoolConfig

    cfg = PoolConfig.from_dict(
        {
            "name": "evev",
            "namespace": "kvray-test",
            "world_size": 1,
            "detached": False,
            "cpus_per_rank": 0.2,
            "mooncake": {"global_segment_size": "32MB", "local_buffer_size": "16MB"},
            "master": {"eviction_high_watermark_ratio": 0.7, "eviction_ratio": 0.5},
            "kv_events": {"host": "loopback", "port": 0, "replay_port": 0},
        },
        environ={},
    )
    space = KeySpace("evev", LAYOUT)
    n = 26  # 26 MB: past the watermark (22.4 MB), within the tier
    hashes, infos = _chain(n)
    value = np.ones(1 << 20, dtype=np.uint8)
    small = np.ones(4096, dtype=np.uint8)
    with Pool.start(cfg) as pool:
        ends = pool.kv_events()
        assert ends is not None
        sub = kv.Subscriber(ends["endpoint"], ends["replay"], TOPIC)
        try:
            time.sleep(0.3)
            pool._h.manager.describe_blocks([Described(space, TOPIC, 16, infos)]).result(30)
            keys = space.rank_key_strs(hashes, 0)
            for at in range(0, n, 8):  # within the client's 16 MB buffer per put
                pool.put(keys[at : at + 8], [value] * len(keys[at : at + 8]))

            def removed() -> list:  # type: ignore[type-arg]
                return [e for e in sub.events if isinstance(e, kv.vk.BlockRemoved)]

            deadline = time.monotonic() + 90
            other = 0
            while not removed() and time.monotonic() < deadline:
                if traffic:
                    pool.put(f"evev-other-{other}", small)  # carries the eviction counter
                    other += 1
                sub.drain(0.3)
            stored = {h for e in sub.events if isinstance(e, kv.vk.BlockStored)
                      for h in e.block_hashes}  # fmt: skip
            assert stored == {kv.ext(h) for h in hashes}, f"{len(stored)} of {n} published"
            assert removed(), f"no eviction published in 90 s ({other} other blocks put)"
            time.sleep(2)  # quiescence plus 2 s
            sub.drain(0.5)
            held = _whole(pool, space, hashes)
            assert 0 < len(held) < n, f"{len(held)} of {n} blocks left after the eviction"
            assert sub.blocks[("CPU", cfg.name)] == held
            found = sum(r.stats.evictions_found for r in pool.stats().ranks)
            assert found == n - len(held), f"the sweep counted {found} evicted"
        finally:
            sub.close()
        pool.shutdown()
