import os
import subprocess
import sys
from dataclasses import replace

import pytest

from kvray.errors import KeyFormatError
from kvray.keys import (
    BlockKey,
    KeySpace,
    KVLayout,
    chain_block_hashes,
    geometry_digest,
    group_geometry_digest,
    hash_block,
    probe_hash,
)

LAYOUT = KVLayout("bfloat16", 128, 8, 128).tag()


def test_layout_tag_round_trip():
    layout = KVLayout("float16", 16, 2, 64)
    assert layout.tag() == "float16-b16-h2x64"
    assert KVLayout.from_tag(layout.tag()) == layout
    with pytest.raises(KeyFormatError, match="block_size"):
        KVLayout("float16", 0, 2, 64)
    with pytest.raises(KeyFormatError, match="dtype"):
        KVLayout("torch.float16", 16, 2, 64)


def test_key_string_round_trip():
    h = hash_block(None, [1, 2, 3])
    key = BlockKey("Qwen/Qwen3-8B", LAYOUT, 3, 1, h)
    s = key.to_str()
    assert s == f"Qwen/Qwen3-8B@{LAYOUT}@tp3@pp1@{h.hex()}"
    assert BlockKey.from_str(s) == key


@pytest.mark.parametrize(
    "bad",
    ["", "a@b", "x", f"m@{LAYOUT}@tp0@pp0@abc", f"m@{LAYOUT}@tpX@pp0@ab", "m@bad@tp0@pp0@ab"],
)
def test_bad_key_strings(bad):
    with pytest.raises(KeyFormatError):
        BlockKey.from_str(bad)


def test_bad_key_fields():
    with pytest.raises(KeyFormatError, match="namespace"):
        BlockKey("has space", LAYOUT, 0, 0, hash_block(None, [1]))
    with pytest.raises(KeyFormatError, match="namespace"):
        BlockKey("a@b", LAYOUT, 0, 0, hash_block(None, [1]))
    with pytest.raises(KeyFormatError, match="ranks"):
        BlockKey("m", LAYOUT, -1, 0, hash_block(None, [1]))


def test_chain_hashes_name_the_prefix():
    tokens = list(range(100))
    hashes = chain_block_hashes(tokens, 16)
    assert len(hashes) == 6  # the partial last block gets no hash
    assert all(len(h) == 32 for h in hashes)
    other = chain_block_hashes([999] + tokens[1:], 16)
    assert all(a != b for a, b in zip(hashes, other))  # a change in block 0 changes all
    assert chain_block_hashes(tokens[:48], 16) == hashes[:3]
    assert chain_block_hashes(tokens, 16, seed=b"other") != hashes


def test_hash_ignores_pythonhashseed():
    code = "from kvray.keys import probe_hash; print(probe_hash())"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "1", "random")
    }
    assert outs == {probe_hash()}


def test_known_hash_vector():
    # Pinned: a change here changes every key in every pool (bump KEY_SCHEMA_VERSION).
    import hashlib
    import struct

    seed = b"kvray-block-hash-v1"
    expect = hashlib.sha256(
        struct.pack("<I", len(seed)) + seed + struct.pack("<I3q", 3, 1, 2, 3) + struct.pack("<I", 0)
    ).digest()
    assert hash_block(None, [1, 2, 3]) == expect


def test_keyspace_rank_keys_match_block_keys():
    space = KeySpace("m", LAYOUT, tp_size=2, pp_size=2)
    hashes = chain_block_hashes(list(range(64)), 16)
    for rank in range(4):
        pp, tp = divmod(rank, 2)
        assert space.rank_key_strs(hashes, rank) == [space.key(h, tp, pp).to_str() for h in hashes]
    with pytest.raises(KeyFormatError, match="outside"):
        space.key(hashes[0], 2, 0)


def test_layer_group_keys():
    space = KeySpace("m", LAYOUT, tp_size=2, pp_size=1, layer_groups=3)
    hashes = chain_block_hashes(list(range(64)), 16)
    for rank in range(2):
        for g in range(3):
            strs = space.rank_key_strs(hashes, rank, g)
            assert strs == [space.key(h, rank, 0, g).to_str() for h in hashes]
            assert all(
                BlockKey.from_str(s) == space.key(h, rank, 0, g) for s, h in zip(strs, hashes)
            )
            assert all(f"@tp{rank}@pp0@lg{g}of3@" in s for s in strs)
    assert len(set(space.lookup_key_strs(hashes))) == space.columns * len(hashes) == 6 * 4
    with pytest.raises(KeyFormatError, match="layer group 3 is outside 0..2"):
        space.rank_key_strs(hashes, 0, 3)
    with pytest.raises(KeyFormatError, match="layer_group must be in"):
        BlockKey("m", LAYOUT, 0, 0, hashes[0], layer_group=1, layer_groups=1)
    # One group: the plain key, unchanged.
    assert "@lg" not in KeySpace("m", LAYOUT).rank_key_strs(hashes, 0)[0]


def test_block_of_key_is_rank_agnostic_and_passes_other_keys_through():
    from kvray.keys import KeySpace, block_of_key

    space = KeySpace("m", "float16-b16-h2x64", tp_size=2, layer_groups=2)
    h = [b"\x01" * 16]
    blocks = {block_of_key(k) for k in space.lookup_key_strs(h)}
    assert blocks == {"m@float16-b16-h2x64@" + h[0].hex()}
    assert block_of_key("blk") == "blk" and block_of_key("a@b") == "a@b"


def test_geometry_digest_names_byte_order_and_layers():
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    g = geometry_digest("p4x256x64", layers)
    assert len(g) == 12 and g == geometry_digest("p4x256x64", list(layers))
    assert g != geometry_digest("p2x128x4x64", layers), "another attention backend's planes"
    assert g != geometry_digest("p4x256x64", layers[:2]), "another PP partition"
    assert geometry_digest("p4x256x64", layers[:2]) != geometry_digest("p4x256x64", layers[2:])


def test_geometry_is_part_of_engine_keys():
    h = hash_block(None, [1, 2, 3])
    ga, gb = geometry_digest("p4x256x64", ["l0"]), geometry_digest("p4x256x64", ["l1"])
    space = KeySpace("m", LAYOUT, tp_size=1, pp_size=2, geometries=(ga, gb))
    key = space.key(h, pp_rank=1)
    assert key.geometry == gb
    assert key.to_str() == f"m@{LAYOUT}@g{gb}@tp0@pp1@{h.hex()}"
    assert BlockKey.from_str(key.to_str()) == key
    assert space.rank_key_strs([h], 1) == [key.to_str()]
    other = KeySpace("m", LAYOUT, tp_size=1, pp_size=2, geometries=(gb, ga))
    assert not set(space.lookup_key_strs([h])) & set(other.lookup_key_strs([h]))
    # keys of no engine (Pool API, tools) have no geometry part
    assert KeySpace("m", LAYOUT).key(h).to_str() == f"m@{LAYOUT}@tp0@pp0@{h.hex()}"


def test_keyspace_geometries_are_checked():
    g = geometry_digest("p1", ["l0"])
    with pytest.raises(KeyFormatError, match="2 ranks"):
        KeySpace("m", LAYOUT, tp_size=2, geometries=(g,))
    with pytest.raises(KeyFormatError, match="not a geometry_digest"):
        KeySpace("m", LAYOUT, geometries=("p4x16",))
    with pytest.raises(KeyFormatError, match="12 lowercase hex"):
        BlockKey("m", LAYOUT, 0, 0, hash_block(None, [1]), geometry="XYZ")
    # a worker knows its own rank's geometry only: asking another's is kvray's bug
    mine = KeySpace("m", LAYOUT, tp_size=2, geometries=("", g))
    assert not mine.complete
    assert mine.rank_key_strs([b"\1"], 1)[0].startswith(f"m@{LAYOUT}@g{g}@tp1@")
    with pytest.raises(KeyFormatError, match="no block geometry for rank 0"):
        mine.rank_key_strs([b"\1"], 0)


def test_a_reset_generation_changes_every_key_of_the_engine_and_only_then():
    """After a reset (vLLM's reset_external) no key of the engine equals one from before;
    generation 0 is the keys engines always had; keys without a geometry (the Pool
    API's) take no generation."""
    h = [hash_block(None, [1, 2, 3]), hash_block(None, [4, 5])]
    ga, gb = geometry_digest("p4x256x64", ["l0"]), geometry_digest("p4x256x64", ["l1"])
    space = KeySpace("m", LAYOUT, tp_size=2, geometries=(ga, gb))
    assert replace(space, generation=0).lookup_key_strs(h) == space.lookup_key_strs(h)
    gens = [set(replace(space, generation=g).lookup_key_strs(h)) for g in range(3)]
    assert all(len(k) == 4 for k in gens)
    assert not gens[0] & gens[1] and not gens[1] & gens[2] and not gens[0] & gens[2]
    key = replace(space, generation=1).key(h[0], tp_rank=1)
    assert BlockKey.from_str(key.to_str()) == key  # the same key format
    with pytest.raises(KeyFormatError, match="generation"):
        KeySpace("m", LAYOUT, generation=1)


def test_each_kv_cache_group_of_a_hybrid_model_has_keys_of_its_own():
    h = hash_block(None, [1, 2, 3])
    layers = ["model.layers.0.attn", "model.layers.1.attn"]
    window = group_geometry_digest("p2x128x2x128", "sliding_window=64", layers[:1])
    full = group_geometry_digest("p2x128x2x128", "full", layers[1:])
    # the same bytes per block and layer, another kind: another digest
    assert group_geometry_digest("p2x128x2x128", "full", layers[:1]) != window
    assert group_geometry_digest("p2x128x2x128", "sliding_window=128", layers[:1]) != window
    # TP 2, two groups: entry rank * 2 + group; ranks share digests (their tp part differs)
    space = KeySpace("m", LAYOUT, tp_size=2, geometries=(window, full, window, full), kv_groups=2)
    assert space.columns == 4
    assert [space.column(c) for c in range(4)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    keys = space.lookup_key_strs([h])
    assert len(set(keys)) == 4
    assert keys[1] == space.key(h, tp_rank=0, kv_group=1).to_str()
    assert f"@g{full}@tp1@" in keys[3] and f"@g{window}@tp1@" in keys[2]
    assert space.column_prefixes() == [k.removesuffix(h.hex()) for k in keys]
    with pytest.raises(KeyFormatError, match="outside 0..1"):
        space.rank_key_strs([h], 0, kv_group=2)
    with pytest.raises(KeyFormatError, match="2 ranks x 2 KV cache groups"):
        KeySpace("m", LAYOUT, tp_size=2, geometries=(window, full), kv_groups=2)
    with pytest.raises(KeyFormatError, match="two KV cache groups of rank 1 share"):
        KeySpace("m", LAYOUT, tp_size=2, geometries=(window, full, full, full), kv_groups=2)


def test_mla_keeps_one_copy_per_block_across_tp_ranks():
    """MLA's latent is the same on every TP rank: TP rank 0's key holds it, every rank
    stores and loads that key, and a lookup asks for one column per PP stage."""
    h = hash_block(None, [1, 2, 3])
    g = geometry_digest("p16x576", ["model.layers.0.self_attn.attn"])
    space = KeySpace("m", LAYOUT, tp_size=2, pp_size=2, geometries=(g,) * 4, tp_replicated=True)
    assert (space.key_ranks, space.columns) == (2, 2)
    assert [space.column(c)[0] for c in range(space.columns)] == [0, 2]  # each stage's rank 0
    assert [space.key_rank(r) for r in range(4)] == [0, 0, 2, 2]
    assert space.rank_key_strs([h], 1) == space.rank_key_strs([h], 0)
    assert "@tp0@pp1@" in space.rank_key_strs([h], 3)[0]
    assert space.lookup_key_strs([h]) == space.rank_key_strs([h], 0) + space.rank_key_strs([h], 2)
    # without it every TP rank has its own key (its own heads)
    plain = KeySpace("m", LAYOUT, tp_size=2, pp_size=2, geometries=(g,) * 4)
    assert plain.columns == 4 and plain.rank_key_strs([h], 1) != plain.rank_key_strs([h], 0)
