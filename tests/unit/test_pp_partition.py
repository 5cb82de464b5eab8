"""A decode instance without PP storing for a 2-stage PP prefill: each block becomes one
key per prefill stage holding that stage's layers, and each prefill stage, keying by its
own PP rank, reads back exactly its layers (round trip through a dict standing in for the
pool's key -> bytes map)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvray.config import ConnectorConfig
from kvray.connector.pp import group_parts, split_columns, stage_parts, stage_ranges
from kvray.errors import ConfigError
from kvray.keys import BlockKey, KeySpace, KVLayout, chain_block_hashes

LAYERS, BLOCKS, BLOCK_BYTES, TP = 5, 4, 256, 2


def region(layers: int, seed: int | None) -> np.ndarray:
    """(layers, blocks, bytes) like vLLM's per-layer KV tensors in one shared region."""
    rng = np.random.default_rng(seed)
    if seed is None:
        return np.zeros((layers, BLOCKS, BLOCK_BYTES), np.uint8)
    return rng.integers(0, 256, (layers, BLOCKS, BLOCK_BYTES), dtype=np.uint8)


def table(kv: np.ndarray, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Offsets/lengths (blocks, layers) into ``kv``, as the worker builds them."""
    layer_offsets = np.array([layer * BLOCKS * BLOCK_BYTES for layer in range(kv.shape[0])])
    ids = np.array(block_ids)
    offsets = layer_offsets[None, :] + ids[:, None] * BLOCK_BYTES
    return offsets, np.full(offsets.shape, BLOCK_BYTES)


def store(pool: dict, kv: np.ndarray, keys, offsets, lengths) -> None:
    base = kv.ctypes.data
    for k, offs, lens in zip(keys, offsets, lengths):
        pool[k] = b"".join(ctypes.string_at(base + int(o), int(n)) for o, n in zip(offs, lens))


def load(pool: dict, kv: np.ndarray, keys, offsets, lengths) -> None:
    flat = kv.reshape(-1)
    for k, offs, lens in zip(keys, offsets, lengths):
        data, at = pool[k], 0
        for o, n in zip(offs, lens):
            flat[int(o) : int(o) + int(n)] = np.frombuffer(data[at : at + int(n)], np.uint8)
            at += int(n)


def test_stage_ranges_and_partition_validation():
    assert stage_ranges([30, 31]) == [(0, 30), (30, 61)]
    cfg = ConnectorConfig(prefill_pp_size=2, prefill_pp_layer_partition="30,31")
    assert cfg.layer_partition(61) == [30, 31]
    with pytest.raises(ConfigError, match="sums to 61 layers but the model has 60"):
        cfg.layer_partition(60)
    assert ConnectorConfig(prefill_pp_size=2).layer_partition(61) == [31, 30]


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_two_stage_partition_keys_round_trip(tp_rank):
    layout = KVLayout("float16", 16, 2, 64).tag()
    space = KeySpace("m", layout, tp_size=TP, pp_size=2)  # the decode side's view
    hashes = chain_block_hashes(list(range(16 * BLOCKS)), 16)
    decode = region(LAYERS, seed=tp_rank)
    stages = stage_ranges([2, 3])
    offsets, lengths = table(decode, [3, 1, 0, 2])
    parts = split_columns(space, hashes, offsets, lengths, stage_parts(space, tp_rank, [2, 3]))
    assert [p[1].shape for p in parts] == [(BLOCKS, 2), (BLOCKS, 3)]
    pool: dict[str, bytes] = {}
    for stage, (keys, offs, lens) in enumerate(parts):
        assert {(BlockKey.from_str(k).pp_rank, BlockKey.from_str(k).tp_rank) for k in keys} == {
            (stage, tp_rank)
        }
        store(pool, decode, keys, offs, lens)
    assert len(pool) == 2 * BLOCKS
    # Each prefill stage p: its own layers only, keyed by its own rank (p * TP + tp_rank).
    for pp, (lo, hi) in enumerate(stages):
        stage_kv = region(hi - lo, seed=None)
        keys = space.rank_key_strs(hashes, pp * TP + tp_rank)
        assert all(BlockKey.from_str(k).pp_rank == pp for k in keys)
        s_off, s_len = table(stage_kv, [0, 1, 2, 3])
        load(pool, stage_kv, keys, s_off, s_len)
        # prefill block j holds what the decode kept in block [3, 1, 0, 2][j]
        assert np.array_equal(stage_kv[:, [0, 1, 2, 3]], decode[lo:hi][:, [3, 1, 0, 2]])


def test_partition_must_cover_every_layer():
    space = KeySpace("m", KVLayout("float16", 16, 2, 64).tag(), tp_size=1, pp_size=2)
    offsets, lengths = table(region(LAYERS, seed=0), [0])
    with pytest.raises(ValueError, match="5 columns .layers. but the parts cover 4"):
        split_columns(space, [b"x" * 32], offsets, lengths, stage_parts(space, 0, [2, 2]))


@pytest.mark.parametrize("planes", [1, 2])
def test_layer_groups_keys_round_trip(planes):
    """Layer-wise keys: each block of a rank is one key per layer group, holding that
    group's columns; the group count is in the key, so another split never matches."""
    layout = KVLayout("float16", 16, 2, 64).tag()
    space = KeySpace("m", layout, tp_size=1, pp_size=1, layer_groups=2)
    hashes = chain_block_hashes(list(range(16 * BLOCKS)), 16)
    kv = region(LAYERS * planes, seed=7)
    offsets, lengths = table(kv, [2, 0, 3, 1])
    parts = group_parts(0, LAYERS, 2, planes)
    assert [(p.lo, p.hi) for p in parts] == [(0, 3 * planes), (3 * planes, 5 * planes)]
    pool: dict[str, bytes] = {}
    for g, (keys, offs, lens) in enumerate(split_columns(space, hashes, offsets, lengths, parts)):
        assert {BlockKey.from_str(k).layer_group for k in keys} == {g}
        assert all(f"@lg{g}of2@" in k for k in keys)
        store(pool, kv, keys, offs, lens)
    assert len(pool) == 2 * BLOCKS
    assert set(pool) == set(space.lookup_key_strs(hashes))
    back = region(LAYERS * planes, seed=None)
    for keys, offs, lens in split_columns(space, hashes, offsets, lengths, parts):
        load(pool, back, keys, offs, lens)
    assert np.array_equal(back[:, [2, 0, 3, 1]], kv[:, [2, 0, 3, 1]])
    # Whole-block keys and another group count name other objects.
    assert not set(pool) & set(KeySpace("m", layout).lookup_key_strs(hashes))
    assert not set(pool) & set(KeySpace("m", layout, layer_groups=3).lookup_key_strs(hashes))


def test_layerwise_and_prefill_pp_split_refused():
    with pytest.raises(ValueError, match="use_layerwise cannot be combined with prefill_pp_size"):
        ConnectorConfig(use_layerwise=True, prefill_pp_size=2)
