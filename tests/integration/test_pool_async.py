"""The Pool API's async twins (for asyncio applications: Ray Serve replicas, async
actors), on each real backend: each answers what its blocking twin answers, on the
caller's event loop, and a pool can be started, attached, closed and shut down from one."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from kvray import Pool
from kvray.backends.base import KeyStatus
from kvray.keys import KeySpace, KVLayout, chain_block_hashes

from .conftest import pool_actor_names, small_config

pytestmark = pytest.mark.integration
_ids = itertools.count()


async def test_async_data_methods_answer_like_their_blocking_twins(pool):
    prefix = f"{pool.config.name}-async{next(_ids)}"
    keys = [f"{prefix}-{i}" for i in range(3)]
    values = [np.full(4096, i + 1, dtype=np.uint8) for i in range(3)]
    await pool.aput(keys, values)
    got = await pool.aget(keys, shape=(4096,), dtype=np.uint8)
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))
    assert await pool.aget(f"{prefix}-none", shape=(4096,), dtype=np.uint8) is None
    assert await pool.aexists([*keys, f"{prefix}-none"]) == pool.exists([*keys, f"{prefix}-none"])
    assert await pool.aremove(keys[:1], force=True) == [KeyStatus.OK]
    assert await pool.aexists(keys) == [False, True, True]

    space = KeySpace(prefix, KVLayout("float16", 16, 2, 64).tag(), tp_size=2)
    hashes = chain_block_hashes(list(range(64)), 16)  # 4 blocks
    block = np.ones(256, np.uint8)
    for rank in (0, 1):
        await pool.aput([space.key(h, rank) for h in hashes[:3]], [block] * 3, rank=rank)
    assert await pool.alookup(space, hashes) == pool.lookup(space, hashes) == 3

    # Several calls in flight on one loop at once, each with its own answer.
    many = await asyncio.gather(*(pool.aexists([k]) for k in keys))
    assert many == [[False], [True], [True]]
    status = await pool.astats()
    assert status.total.lookups >= 2 and len(status.ranks) == 2


async def test_a_pool_started_attached_and_stopped_from_an_event_loop(ray_cluster, mooncake_master):
    cfg = small_config(mooncake_master.address, world_size=1)
    pool = await Pool.astart(cfg)
    try:
        other = await Pool.aattach(cfg.name, cfg.namespace)
        await pool.aput("k", np.arange(16, dtype=np.uint8))
        got = await other.aget("k", shape=(16,), dtype=np.uint8)
        assert got is not None and np.array_equal(got, np.arange(16, dtype=np.uint8))
        await other.aclose()
        assert await pool.aexists(["k"]) == [True]  # closing a client leaves the pool
    finally:
        await pool.ashutdown()
    assert pool_actor_names(cfg) == []
