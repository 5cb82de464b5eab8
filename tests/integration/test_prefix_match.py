"""``Pool.prefix_match`` and ``kvray prefix-match`` on a real pool (real Ray, a real
mooncake_master and clients, ``lookup_index: true``): the leading blocks every rank of a
key space holds, in the DRAM tier and per node, as the manager's block index knows them;
a block is counted only when every rank's column of it is held; removes take it back; with
the SSD tier, the node's count includes what only its disk holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvray import Pool
from kvray.errors import ConfigError
from kvray.index.prefix_match import PrefixMatch
from kvray.keys import KeySpace, KVLayout, chain_block_hashes

from .conftest import small_config, ssd_pool_config

pytestmark = pytest.mark.integration
LAYOUT = KVLayout("float16", 16, 2, 64).tag()


def settled(pool: Pool, space: KeySpace, hashes: list[bytes], dram: int) -> PrefixMatch:
    """The pool's answer once its DRAM count is ``dram`` (the hub has a store's changes a
    report after the store returned); fails after 20 s."""
    deadline = time.monotonic() + 20
    while (got := pool.prefix_match(space, hashes)).dram != dram:
        assert time.monotonic() < deadline, f"prefix_match shows {got}, not {dram} in DRAM"
        time.sleep(0.05)
    return got


def test_leading_blocks_held_by_every_rank_per_tier_and_node(ray_cluster, mooncake_master):
    cfg = small_config(mooncake_master.address, lookup_index=True)
    space = KeySpace(cfg.name, LAYOUT, tp_size=2)
    hashes = chain_block_hashes(list(range(16 * 6)), 16)
    block = np.arange(4096, dtype=np.uint8)
    with Pool.start(cfg) as pool:
        node = pool._h.node_id
        assert pool.prefix_match(space, hashes).nodes == {node: 0}
        pool.put(space.rank_key_strs(hashes[:5], 0), [block] * 5, rank=0)
        pool.put(space.rank_key_strs(hashes[:3], 1), [block] * 3, rank=1)
        found = settled(pool, space, hashes, 3)  # rank 1 holds only the first 3
        assert (found.blocks, found.dram, found.ssd, found.nodes) == (6, 3, {}, {node: 3})
        assert found.addresses[node] == "127.0.0.1"
        pool.remove(space.rank_key_strs(hashes[1:2], 0), force=True)
        assert settled(pool, space, hashes, 1).nodes == {node: 1}
        # Another key space (another model's keys) holds nothing of it.
        other = KeySpace(cfg.name + "-other", LAYOUT, tp_size=2)
        assert pool.prefix_match(other, hashes).dram == 0

        # The CLI: the key space as the connector's scheduler logs it.
        geometries = ",".join(space.geometries)
        keys = f"{space.namespace}@{space.layout}, block geometries {geometries}"
        env = {**os.environ, "RAY_ADDRESS": ray_cluster}
        run = subprocess.run(
            [sys.executable, "-m", "kvray.cli", "--name", cfg.name, "--namespace",
             cfg.namespace, "prefix-match", "--keys", keys, "--tp-size", "2", "--json",
             *(h.hex() for h in hashes)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(run.stdout)["nodes"] == {node: 1}
        bad = subprocess.run(
            [sys.executable, "-m", "kvray.cli", "prefix-match", "--keys", "nonsense", "ab"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert bad.returncode != 0 and "--keys 'nonsense' is not a key space" in bad.stderr
        pool.shutdown()


def test_a_pool_without_its_index_says_how_to_get_one(ray_cluster, mooncake_master):
    cfg = small_config(mooncake_master.address, lookup_index=False)
    with Pool.start(cfg) as pool:
        with pytest.raises(ConfigError, match="lookup_index: true"):
            pool.prefix_match(KeySpace(cfg.name, LAYOUT, tp_size=2), [b"\x01" * 32])
        pool.shutdown()


def test_a_nodes_count_includes_what_only_its_ssd_tier_holds(ray_cluster, tmp_path):
    """With the SSD tier, a node's count is DRAM or its disk: after a restart of the pool
    over the same disk (DRAM empty), the blocks are still the node's, not the DRAM's."""
    cfg = ssd_pool_config(tmp_path, "pmssd", lookup_index=True)
    space = KeySpace("pmssd", LAYOUT)
    hashes = chain_block_hashes(list(range(16 * 4)), 16)
    block = np.ones(4096, np.uint8)

    def until(pool: Pool, want: dict[str, int]) -> PrefixMatch:
        deadline = time.monotonic() + 20
        while (found := pool.prefix_match(space, hashes)).ssd != want:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        return found

    with Pool.start(cfg) as pool:
        node = pool._h.node_id
        pool.put(space.rank_key_strs(hashes[:3], 0), [block] * 3)
        found = until(pool, {node: 3})
        assert (found.dram, found.nodes) == (3, {node: 3})
        pool.shutdown()
    with Pool.start(cfg) as pool:  # DRAM empty; the SSD tier announces what it holds
        found = until(pool, {node: 3})
        assert (found.dram, found.nodes) == (0, {node: 3}), found
        pool.shutdown()
