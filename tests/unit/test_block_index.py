"""The node's block index (kvray/index/block_index.py): digests that a scheduler computes from a
request's hashes equal those the keeper computes from key strings; what the keeper writes
is what a reader in another process reads; removals, capacity and full probe runs keep it
a correct subset of what was stored, never a superset."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvray.errors import ConfigError, RegionError
from kvray.index.block_index import (
    DRAM,
    MAX_PLACES,
    MAX_PROBES,
    BlockIndex,
    column_salt,
    digests,
    fold_hashes,
    key_digests,
    space_digests,
)
from kvray.keys import KeySpace

LAYOUT = "bfloat16-b16-h2x64"
GEO = ("0123456789ab", "ba9876543210")


@pytest.fixture
def index():
    ix = BlockIndex.create(1000)
    yield ix
    ix.close()


def hashes(n: int, seed: int = 0, length: int = 32) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(length) for _ in range(n)]


@pytest.mark.parametrize(
    "space",
    [
        KeySpace("ns", LAYOUT),
        KeySpace("ns", LAYOUT, tp_size=2, geometries=GEO),
        KeySpace("other/ns", LAYOUT, tp_size=2, layer_groups=3, geometries=GEO),
    ],
)
def test_scheduler_digests_equal_the_keepers_from_key_strings(space):
    # Every hash length a key may have (1-64 bytes), in one batch and one by one.
    hs = [os.urandom(n) for n in range(1, 65)] + hashes(100)
    want = key_digests(space.lookup_key_strs(hs))
    assert (space_digests(space, hs).ravel() == want).all()
    tail = hs[70:]
    assert (space_digests(space, tail).ravel() == key_digests(space.lookup_key_strs(tail))).all()
    # Columns, namespaces and hashes all change the digest.
    assert len(set(want.tolist())) == len(want)
    other = KeySpace("ns2", LAYOUT, tp_size=space.tp_size, geometries=space.geometries)
    assert not set(space_digests(other, hs).ravel().tolist()) & set(want.tolist())


def test_hashes_that_differ_past_their_first_word_differ():
    space = KeySpace("ns", LAYOUT)
    hs = [b"block-000000000" + bytes([i]) for i in range(200)] + [b"x" * 8 + b"\0", b"x" * 8]
    d = space_digests(space, hs).ravel()
    assert len(set(d.tolist())) == len(hs)


def test_pool_api_keys_are_their_own_column():
    keys = ["plain", "a@b", "a@zz", "a@00ff", "", "@"]
    d = key_digests(keys)
    assert len(set(d.tolist())) == len(keys)
    assert (key_digests(keys) == d).all()


def test_a_batchs_digests_are_each_keys_own():
    """Keys digested together (one column's hashes at once, the keys that are their own
    column at once) read as each digested alone, whatever else the batch holds."""
    space = KeySpace("ns", LAYOUT)
    hs = [bytes([i]) * 32 for i in range(5)]
    keys = [f"kv-{i}" for i in range(50)] + space.lookup_key_strs(hs)
    keys += ["a@", "a@zz", "a@0g", "x@ab", "x@abcd", "x@abc", "", "@", "@ff", "p@q@ff00"]
    together = key_digests(keys)
    alone = [int(key_digests([k])[0]) for k in keys]
    assert together.tolist() == alone
    assert len(set(alone)) == len(keys)
    own = digests(column_salt("kv-7"), fold_hashes([b""]))
    assert together[7] == own


def test_reader_in_another_process_sees_what_the_keeper_wrote(index, tmp_path):
    space = KeySpace("ns", LAYOUT, tp_size=2, geometries=GEO)
    hs = hashes(50)
    index.add(key_digests(space.lookup_key_strs(hs[:40])))
    bit = index.place_bit("node-a", 3)
    index.add(key_digests(space.rank_key_strs(hs[40:], 1)), bit)
    spec = tmp_path / "spec"
    import pickle

    spec.write_bytes(pickle.dumps((index.spec, space, hs)))
    code = textwrap.dedent(f"""
        import pickle
        from kvray.index.block_index import BlockIndex, space_digests
        spec, space, hs = pickle.loads(open({str(spec)!r}, "rb").read())
        ix = BlockIndex.attach(spec)
        print(ix.place_bit("node-a", 3), ix.place_bit("node-b", 0), len(ix))
        print(" ".join(str(int(v)) for v in ix.tiers(space_digests(space, hs).ravel())))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    assert out[0].split() == [str(bit), "0", "90"]
    tiers = np.array(out[1].split(), dtype=np.uint32).reshape(2, 50)
    assert (tiers[:, :40] == DRAM).all()
    assert (tiers[0, 40:] == 0).all() and (tiers[1, 40:] == bit).all()


def test_tiers_add_and_clear_per_bit(index):
    d = key_digests([f"ns@l@{i:04x}" for i in range(20)])
    ssd = index.place_bit("n", 0)
    index.add(d, DRAM)
    index.add(d[:10], ssd)
    assert (index.tiers(d[:10]) == DRAM | ssd).all() and (index.tiers(d[10:]) == DRAM).all()
    index.remove(d, DRAM)  # evicted from DRAM: the first ten stay on SSD
    assert (index.tiers(d[:10]) == ssd).all() and (index.tiers(d[10:]) == 0).all()
    assert len(index) == 10
    index.remove(d[:10], ssd)
    assert len(index) == 0 and not index.tiers(d).any()


def test_places_are_registered_once_and_capped(index):
    bits = [index.place_bit(f"node-{i}", i % 2) for i in range(MAX_PLACES)]
    assert bits == [1 << (i + 1) for i in range(MAX_PLACES)]
    assert index.place_bit("node-0", 0) == 2
    assert index.place_bit("one-too-many", 0) == 0  # its blocks read as misses
    with pytest.raises(RegionError, match="longer than"):
        BlockIndex.create(10).place_bit("x" * 100, 0)


def test_random_history_matches_a_set_and_stays_bounded():
    """Adds and removes at random, past the capacity many times over (so the oldest are
    dropped and the deleted slots are rebuilt away): every digest the index shows was
    stored and not removed since, the newest batch is always all there, and the table
    never holds more than its capacity."""
    ix = BlockIndex.create(500)
    rng = np.random.default_rng(1)
    held: set[int] = set()
    for step in range(300):
        batch = rng.integers(2, 1 << 62, size=int(rng.integers(1, 120)), dtype=np.uint64)
        ix.add(batch)
        held |= set(batch.tolist())
        if step % 3 == 0:
            gone = rng.choice(np.array(sorted(held), dtype=np.uint64), size=min(40, len(held)))
            ix.remove(gone)
            held -= set(gone.tolist())
        shown = {int(d) for d, v in zip(ix._keys, ix._vals) if d > 1 and v}
        assert shown <= held, "the index shows a block that was removed or never stored"
        assert len(ix) == len(shown) <= ix.capacity
        assert (ix.tiers(batch[np.isin(batch, list(held))]) == DRAM).all()
    assert ix.dropped == 0


def test_a_full_probe_run_drops_the_rest_as_misses():
    ix = BlockIndex.create(200)
    # Digests that all hash to slot 5: one run of MAX_PROBES slots, the rest dropped.
    d = np.array([5 + ix.slots * (i + 1) for i in range(MAX_PROBES + 10)], dtype=np.uint64)
    ix.add(d)
    assert ix.dropped == 10 and len(ix) == MAX_PROBES
    assert int(np.count_nonzero(ix.tiers(d))) == MAX_PROBES


def test_a_read_during_a_write_retries_then_answers(index):
    d = key_digests(["ns@l@00"])
    index.add(d)
    index._head[1] += 1  # a batch being written, forever
    assert index.tiers(d).tolist() == [DRAM]
    assert index.torn_reads == 1
    index._head[1] += 1


def test_sizes_are_checked():
    with pytest.raises(ConfigError, match="capacity must be >= 1"):
        BlockIndex.size_for(0)
    slots, size = BlockIndex.size_for(1 << 20)
    assert slots == 1 << 21 and size == 4096 + 16 * slots
    ix = BlockIndex.create(10)
    with pytest.raises(RegionError, match="not a block index"):
        BlockIndex(ix._region, ix.slots * 2, writer=False)
