"""One rank's DRAM-then-SSD tiers (kvray.store.tiers) without Ray: both tiers are real
stores in this process (the SSD tier's files on the real disk; for the upper tier an
SSD tier too, or the checksum wrapper over one where a test needs a corrupt block)."""

from __future__ import annotations

import asyncio

import numpy as np

from kvray.backends.base import KeyStatus
from kvray.backends.checksum import ChecksummedBackend
from kvray.backends.ssd import SsdBackend
from kvray.config import SsdConfig
from kvray.index.ledger import Seen, block_digest
from kvray.shm import SharedRegion
from kvray.store.rank_store import RankStore
from kvray.store.tiers import TieredStore
from kvray.transfer import TransferBatch

BLOCK = 64 << 10


def store(path, checksum: bool = False) -> RankStore:
    path.mkdir()
    backend = SsdBackend(SsdConfig(path=str(path), quota="4MB", io_threads=2), 0)
    return RankStore(ChecksummedBackend(backend) if checksum else backend, 0)


def batch(region: SharedRegion, keys: list[str], first: int = 0) -> TransferBatch:
    offsets = [(first + i) * BLOCK for i in range(len(keys))]
    return TransferBatch.contiguous(region.spec, keys, offsets, [BLOCK] * len(keys))


def fill(region: SharedRegion, n: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)
    region.array[: n * BLOCK] = data.reshape(-1)
    return data


def blocks(region: SharedRegion, n: int, first: int = 0) -> np.ndarray:
    return region.array[first * BLOCK : (first + n) * BLOCK].reshape(n, BLOCK).copy()


def run(coro):
    return asyncio.run(coro)


def test_writes_go_through_and_the_lower_tier_serves_what_dram_lost(tmp_path):
    region = SharedRegion.create("kvray-test-tiers", 8 * BLOCK)
    dram, ssd = store(tmp_path / "dram"), store(tmp_path / "ssd")
    tiers = TieredStore(dram, ssd)

    async def scenario() -> None:
        keys = [f"k{i}" for i in range(4)]
        src = fill(region, 4, 1)
        assert await tiers.put(batch(region, keys)) == [KeyStatus.OK] * 4
        assert await ssd.exists(keys) == [True] * 4  # written through
        assert dram.stats.ssd_put_keys == 4
        # DRAM loses two blocks (evicted behind kvray's back): the SSD tier serves them.
        await dram.backend.remove(keys[:2])
        got = await tiers.get(batch(region, keys, first=4))
        assert got == [KeyStatus.OK] * 4
        assert np.array_equal(blocks(region, 4, first=4), src)
        assert (dram.stats.ssd_get_keys, dram.stats.ssd_get_bytes) == (2, 2 * BLOCK)
        assert await tiers.exists(keys) == [True] * 4  # two in DRAM, all four on SSD
        # Removed from both: absent everywhere; the ledger hears stored, then removed.
        assert await tiers.remove(keys) == [KeyStatus.OK] * 4
        assert await tiers.exists(keys) == [False] * 4
        assert await tiers.get(batch(region, keys)) == [KeyStatus.NOT_FOUND] * 4
        changes = tiers.take_changes()
        assert [(d, w) for d, w, _ in changes.rows()] == [
            *((block_digest(k), int(Seen.STORED)) for k in keys),
            *((block_digest(k), int(Seen.REMOVED)) for k in keys),
        ]
        assert len(tiers.take_changes()) == 0
        await tiers.release_region(region.spec.region_id)
        assert dram.stats.regions == 0 and ssd.stats.regions == 0

    try:
        run(scenario())
    finally:
        region.close()


def test_a_block_failing_its_dram_checksum_is_served_by_the_lower_tier(tmp_path):
    region = SharedRegion.create("kvray-test-tiers", 4 * BLOCK)
    dram, ssd = store(tmp_path / "dram", checksum=True), store(tmp_path / "ssd")
    tiers = TieredStore(dram, ssd)

    async def scenario() -> None:
        src = fill(region, 1, 2)
        assert await tiers.put(batch(region, ["k"])) == [KeyStatus.OK]
        # The DRAM tier's copy is replaced, behind the wrapper, by other bytes and a
        # trailer that is not their checksum (same size: only the checksum can tell).
        inner = dram.backend.inner  # type: ignore[attr-defined]
        await inner.remove(["k"])
        await dram.ensure_region(region.spec)
        region.array[BLOCK : 2 * BLOCK + 8] = 7
        ptr = region.base_ptr + BLOCK
        assert await inner.put(["k"], [[ptr]], [[BLOCK + 8]]) == [KeyStatus.OK]
        assert await dram.get(batch(region, ["k"], first=2)) == [KeyStatus.CORRUPT]
        assert await tiers.get(batch(region, ["k"], first=3)) == [KeyStatus.OK]
        assert np.array_equal(blocks(region, 1, first=3), src)
        assert dram.stats.ssd_get_keys == 1

    try:
        run(scenario())
    finally:
        region.close()


def test_without_a_lower_tier_a_dram_miss_is_a_miss(tmp_path):
    region = SharedRegion.create("kvray-test-tiers", 2 * BLOCK)
    dram = store(tmp_path / "dram")
    tiers = TieredStore(dram)

    async def scenario() -> None:
        fill(region, 1, 3)
        assert await tiers.put(batch(region, ["a"])) == [KeyStatus.OK]
        assert dram.stats.ssd_put_keys == 0
        assert await tiers.get(batch(region, ["a", "b"])) == [KeyStatus.OK, KeyStatus.NOT_FOUND]
        assert await tiers.exists(["a", "b"]) == [True, False]
        assert await tiers.remove(["b"]) == [KeyStatus.NOT_FOUND]
        assert [w for _, w, _ in tiers.take_changes()] == [int(Seen.STORED)]

    try:
        run(scenario())
    finally:
        region.close()


def test_the_index_hears_each_tier_store_remove_and_find_keys_gone(tmp_path):
    """A call given an ``index`` list: what each tier took, what kvray removed, and what a
    load found gone from a tier (DRAM evicted behind kvray's back), each its own entry."""
    from kvray.index.stream import OP_ADD, OP_GONE, OP_REMOVE

    region = SharedRegion.create("kvray-test-tiers", 8 * BLOCK)
    dram, ssd = store(tmp_path / "dram"), store(tmp_path / "ssd")
    tiers = TieredStore(dram, ssd)

    async def scenario() -> None:
        keys = [f"k{i}" for i in range(4)]
        fill(region, 4, 1)
        noted: list = []
        await tiers.put(batch(region, keys), index=noted)
        assert noted == [(OP_ADD, False, keys), (OP_ADD, True, keys)]
        await dram.backend.remove(keys[:2])  # evicted: only a load finds out
        noted = []
        assert await tiers.get(batch(region, keys, first=4), index=noted) == [KeyStatus.OK] * 4
        assert noted == [(OP_GONE, False, keys[:2])]
        await ssd.backend.remove(keys[3:])
        noted = []
        assert await tiers.remove(keys[2:], index=noted) == [KeyStatus.OK] * 2
        # DRAM had both; the SSD tier only k2 (k3 was already gone: gone either way).
        assert noted == [(OP_REMOVE, False, keys[2:]), (OP_REMOVE, True, keys[2:])]
        assert await tiers.get(batch(region, keys)) is not None  # no list: nothing noted

    try:
        run(scenario())
    finally:
        region.close()
