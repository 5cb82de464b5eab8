"""The node's block index on a real pool (``lookup_index: true``): real Ray, a real
mooncake_master and clients. What the pool's clients on this node store is in the index
that the node's Lookup actor keeps by the time the store returns, and a process that maps
it (as a scheduler does) reads every rank's column there; kvray's removes and a load that
finds a block evicted leave their markers, as the call returns too; with the SSD tier,
the blocks carry the bit of the node slot whose disk holds them once the manager's
stream named that place."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray

from kvray import Pool
from kvray.backends.base import KeyStatus
from kvray.index.block_index import DRAM, GONE, REMOVED, BlockIndex, space_digests
from kvray.keys import KeySpace, KVLayout, chain_block_hashes
from kvray.naming import ssd_name
from kvray.remote import StoreHandle

from .conftest import small_config, ssd_pool_config

pytestmark = pytest.mark.integration
LAYOUT = KVLayout("float16", 16, 2, 64).tag()


def mapped(pool: Pool) -> BlockIndex:
    """The node's index, mapped as the connector's scheduler maps it."""
    spec = pool._h.lookup().index_spec().result(30)
    assert spec is not None, "lookup_index: true, and the Lookup actor offers no index"
    return BlockIndex.attach(spec)


def shows(index: BlockIndex, d: np.ndarray, want: list[int]) -> None:
    """The index shows tier masks ``want`` for ``d`` now."""
    assert index.tiers(d).tolist() == want


def until(index: BlockIndex, d: np.ndarray, want: list[int], timeout_s: float = 20) -> float:
    """Seconds until the index shows tier masks ``want`` for ``d`` (fails at timeout)."""
    t0 = time.monotonic()
    while (got := index.tiers(d).tolist()) != want:
        assert time.monotonic() - t0 < timeout_s, f"index shows {got}, not {want}"
        time.sleep(0.002)
    return time.monotonic() - t0


def test_stores_removes_and_evictions_reach_the_nodes_index(ray_cluster, mooncake_master):
    cfg = small_config(mooncake_master.address, lookup_index=True)
    space = KeySpace(cfg.name, LAYOUT, tp_size=2)
    hashes = chain_block_hashes(list(range(16 * 6)), 16)
    block = np.arange(4096, dtype=np.uint8)
    with Pool.start(cfg) as pool:
        index = mapped(pool)
        try:
            # Attached once the keeper has the pool's stream: current from the start.
            assert index.age_s() < 5, "the index was handed out before its first sync"
            d = space_digests(space, hashes)  # (2 ranks, 6 blocks)
            assert not index.tiers(d.ravel()).any()
            pool.put(space.rank_key_strs(hashes, 0), [block] * 6, rank=0)
            shows(index, d[0], [DRAM] * 6)
            assert not index.tiers(d[1]).any()  # rank 1 stored nothing yet
            pool.put(space.rank_key_strs(hashes, 1), [block] * 6, rank=1)
            shows(index, d[1], [DRAM] * 6)
            # The clients handed their changes to the keeper on its node channel, not as
            # Ray calls.
            lookup = pool._h.lookup()
            assert lookup.snapshot().result(30)["index_channel_applies"] >= 2

            # kvray removes rank 0's first block: it says so.
            assert pool.remove(space.rank_key_strs(hashes[:1], 0), force=True) == [KeyStatus.OK]
            shows(index, d[0, :1], [REMOVED])
            # Stored again: back in its tier.
            pool.put(space.rank_key_strs(hashes[:1], 0), [block], rank=0)
            shows(index, d[0, :1], [DRAM])
            assert index.age_s() < 5, "the keeper is not current"
            # A step's pin: the Lookup actor's exists over every rank's key, counted.
            before = lookup.snapshot().result(30)["stats"]["pins"]
            lookup.pin(space, hashes, 5.0).result(30)
            after = lookup.snapshot().result(30)["stats"]
            assert (after["pins"], after["pin_failures"]) == (before + 1, 0)
        finally:
            index.close()
        pool.shutdown()


def test_a_block_the_backend_lost_is_marked_gone(ray_cluster, mooncake_master):
    """The DRAM tier loses a block without kvray (another Mooncake client removes it by
    its key, as an eviction would): the BackendClient that stored it finds it gone (its
    eviction sweep: this external master reports no eviction counter, so it asks about
    its oldest keys every second; or a load, whichever comes first) and the index marks
    it so."""
    from kvray.backends import make_backend

    cfg = small_config(mooncake_master.address, lookup_index=True, world_size=1)
    space = KeySpace(cfg.name, LAYOUT)
    hashes = chain_block_hashes(list(range(16 * 3)), 16)
    keys = space.rank_key_strs(hashes, 0)
    with Pool.start(cfg) as pool:
        index = mapped(pool)
        try:
            d = space_digests(space, hashes).ravel()
            pool.put(keys, [np.ones(4096, np.uint8)] * 3)
            shows(index, d, [DRAM] * 3)

            async def evict() -> list[KeyStatus]:
                raw = make_backend(cfg, pool.server_address, contribute_memory=False)
                try:
                    return await raw.remove(keys[:1], force=True)
                finally:
                    await raw.close()

            assert asyncio.run(evict()) == [KeyStatus.OK]
            until(index, d[:1], [GONE])  # the sweep found it, with no load
            shows(index, d[1:], [DRAM] * 2)  # the others are still there
            assert pool.get(keys[0], shape=(4096,), dtype=np.uint8) is None
            shows(index, d[:1], [GONE])
        finally:
            index.close()
        pool.shutdown()


def ssd_bit(pool: Pool, index: BlockIndex) -> int:
    """The bit of this node's slot 0 SSD tier, once the manager's stream named it."""
    t0 = time.monotonic()
    while not (bit := index.place_bit(pool._h.node_id, 0)):
        assert time.monotonic() - t0 < 20, "the SSD place never reached the index"
        time.sleep(0.01)
    return bit


def test_ssd_blocks_carry_their_slots_bit_leave_it_when_evicted_and_return_at_restart(
    ray_cluster, tmp_path
):
    """The SSD tier's blocks carry its node slot's bit; its quota's evictions take the
    bit away (the DRAM copy stays); a new pool on the same disk announces what the tier
    still holds, so those blocks are hits again with DRAM empty."""
    cfg = ssd_pool_config(tmp_path, "ixssd", lookup_index=True, ssd={"quota": "1MB"})
    space = KeySpace("ixssd", LAYOUT)
    hashes = chain_block_hashes(list(range(16 * 400)), 16)  # 400 blocks of 4 KiB: > 1 MB
    d = space_digests(space, hashes).ravel()
    block = [np.ones(4096, np.uint8)]
    with Pool.start(cfg) as pool:
        index = mapped(pool)
        try:
            keys = space.rank_key_strs(hashes, 0)
            pool.put(keys[:4], block * 4)
            bit = ssd_bit(pool, index)
            until(index, d[:4], [DRAM | bit] * 4)
            for i in range(4, 400, 50):
                pool.put(keys[i : i + 50], block * len(keys[i : i + 50]))
            shows(index, d[:4], [DRAM] * 4)  # evicted from SSD as the quota filled
            tail = index.tiers(d[-50:]).tolist()
            assert tail == [DRAM | bit] * 50, tail
            # Exactly what the SSD tier holds (its writes run in parallel threads, so not
            # exactly the oldest went first), once its last evictions' changes arrived
            # (seconds on a host loaded past its cores).
            actor = ray.get_actor(ssd_name(cfg.name, pool._h.node_id, 0), namespace=cfg.namespace)
            on_disk = StoreHandle(actor, "ssd").exists(keys).result(30)
            disk = [i for i, there in enumerate(on_disk) if there]
            t0 = time.monotonic()
            while (held := [i for i, v in enumerate(index.tiers(d).tolist()) if v & bit]) != disk:
                assert time.monotonic() - t0 < 20, (held, disk)
                time.sleep(0.05)
            assert 100 < len(held) < 400
        finally:
            index.close()
        pool.shutdown()
    with Pool.start(cfg) as pool:  # DRAM is empty: only the SSD tier's announcement
        index = mapped(pool)
        try:
            bit = ssd_bit(pool, index)
            until(index, d[held], [bit] * len(held))
            shows(index, d[:4], [0] * 4)
        finally:
            index.close()
        pool.shutdown()
