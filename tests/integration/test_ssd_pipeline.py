"""The ``<backend>|ssd`` pipeline on a real pool: a real mooncake_master with a DRAM pool
too small for the data, kvray's SSD tier on the real disk under it."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from kvray import Pool
from kvray.keys import KeySpace, KVLayout, chain_block_hashes
from kvray.naming import ssd_name

from .conftest import ssd_pool_config

pytestmark = pytest.mark.integration
MB = 1 << 20


def test_dram_miss_is_served_from_ssd_and_survives_a_pool_restart(ray_cluster, tmp_path):
    cfg = ssd_pool_config(tmp_path, "ssdp")
    values = [np.full(MB, i, dtype=np.uint8) for i in range(40)]  # 40 MB into a 16 MB pool
    keys = [f"ssdp-{i}" for i in range(40)]
    space = KeySpace("ssdp", KVLayout("float16", 16, 2, 64).tag())
    hashes = chain_block_hashes(list(range(16 * 8)), 16)
    block = np.arange(4096, dtype=np.uint8)
    with Pool.start(cfg) as pool:
        for k, v in zip(keys, values):  # one at a time: DRAM fills and evicts or refuses
            pool.put(k, v)
        pool.put([space.key(h) for h in hashes], [block] * 8)
        outs = pool.get(keys, out=[np.empty(MB, np.uint8) for _ in keys])
        assert all(o is not None and np.array_equal(o, v) for o, v in zip(outs, values))
        stats = pool.stats()
        assert stats.total.ssd_get_keys > 0, "nothing came from the SSD tier"
        assert stats.total.ssd_put_keys == 48 and stats.total.ssd_blocks == 48
        assert "ssd used" in stats.table()
        assert (tmp_path / "rank_0" / "blocks").is_dir()
        pool.shutdown()
    with pytest.raises(ValueError):
        node = ray.get_runtime_context().get_node_id()
        ray.get_actor(ssd_name(cfg.name, node, 0), namespace=cfg.namespace)
    # A new pool on the same SSD path: DRAM is empty, the SSD tier still has every block.
    with Pool.start(cfg) as pool:
        assert pool.lookup(space, hashes) == 8
        assert pool.stats().total.lookup_ssd_blocks == 8
        outs = pool.get(keys[:5], out=[np.empty(MB, np.uint8) for _ in range(5)])
        assert all(np.array_equal(o, v) for o, v in zip(outs, values[:5]))
        assert pool.stats().total.ssd_get_keys == 5
        pool.shutdown()


def test_remove_drops_both_tiers(ray_cluster, tmp_path):
    cfg = ssd_pool_config(tmp_path, "ssdr")
    with Pool.start(cfg) as pool:
        pool.put("ssdr-x", np.ones(4096, np.uint8))
        assert pool.exists(["ssdr-x"]) == [True]
        from kvray.backends.base import KeyStatus

        assert pool.remove(["ssdr-x"], force=True) == [KeyStatus.OK]
        assert pool.exists(["ssdr-x"]) == [False]
        assert pool.get("ssdr-x", out=np.empty(4096, np.uint8)) is None
        pool.shutdown()
