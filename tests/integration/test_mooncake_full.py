"""A Mooncake pool that stays full, as a cache does: the master evicts asynchronously, so
a burst of puts into the full pool finds no room until an eviction round ran. The adapter
puts those keys again once it has, so the burst is stored and nothing of it is dropped.
And how many blocks a full segment holds with checksum trailers and without."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvray.backends import mooncake
from kvray.backends.base import Backend, KeyStatus
from kvray.backends.checksum import ChecksummedBackend
from kvray.backends.mooncake import MooncakeBackend
from kvray.config import MooncakeConfig, MooncakeMasterConfig
from kvray.servers.mooncake_master import MooncakeMaster

MB = 1 << 20
SEGMENT = 64 * MB
BLOCK = 64 << 10


def test_bursts_into_a_full_pool_are_stored(mooncake_master):
    async def run() -> None:
        cfg = MooncakeConfig(global_segment_size=64 * MB, local_buffer_size=16 * MB,
                             protocol="tcp")  # fmt: skip
        backend = MooncakeBackend(cfg, mooncake_master.address, io_threads=2)
        data = np.random.default_rng(0).integers(0, 256, 160 * MB, dtype=np.uint8)
        out = np.zeros(32 * MB, dtype=np.uint8)
        try:
            await backend.register_region(data.ctypes.data, data.nbytes)
            await backend.register_region(out.ctypes.data, out.nbytes)
            for burst in range(5):  # 160 MiB, back to back, into 64 MiB
                keys = [f"b{burst}-{i}" for i in range(32)]
                base = data.ctypes.data + burst * 32 * MB
                ptrs = [[base + i * MB] for i in range(32)]
                statuses = await backend.put(keys, ptrs, [[MB]] * 32)
                assert statuses == [KeyStatus.OK] * 32, (burst, statuses)
            # The last burst reads back whole; the oldest blocks made room for it.
            got = await backend.get(keys, [[out.ctypes.data + i * MB] for i in range(32)],
                                    [[MB]] * 32)  # fmt: skip
            assert got == [KeyStatus.OK] * 32
            assert np.array_equal(out, data[4 * 32 * MB :])
            assert not all(await backend.exists([f"b0-{i}" for i in range(32)]))
        finally:
            await backend.close()

    asyncio.run(run())


@pytest.fixture
def unevicting_master(tmp_path):
    """A mooncake_master that evicts only once its segment is full."""
    master = MooncakeMaster(MooncakeMasterConfig(eviction_high_watermark_ratio=1.0), tmp_path)
    master.start()
    yield master
    master.stop()
    assert not master.alive()


def test_a_checksum_trailer_takes_a_block_into_the_allocators_next_size(
    unevicting_master, monkeypatch
):
    """What docs/reliability.md says a trailer costs on Mooncake: its offset allocator hands
    out eight sizes per power of two, and a 64 KiB block with its 8-byte trailer takes the
    next one (72 KiB), so a segment holds 8/9 of the blocks it holds without checksums.
    Counted until the first put that finds the segment full (the adapter's waits for an
    eviction round left out: they are not what this measures)."""
    monkeypatch.setattr(mooncake, "FULL_RETRY_S", ())

    async def fill(backend: Backend) -> int:
        data = np.zeros(BLOCK, dtype=np.uint8)
        await backend.register_region(data.ctypes.data, data.nbytes)
        stored = 0
        while stored < 2 * SEGMENT // BLOCK:
            (status,) = await backend.put([f"b{stored}"], [[data.ctypes.data]], [[BLOCK]])
            if status is not KeyStatus.OK:
                assert status is KeyStatus.POOL_FULL, status
                return stored
            stored += 1
        raise AssertionError(f"{stored} blocks of {BLOCK} bytes fit in {SEGMENT}")

    async def run(checksum: bool) -> int:
        cfg = MooncakeConfig(global_segment_size=SEGMENT, local_buffer_size=16 * MB,
                             protocol="tcp")  # fmt: skip
        backend: Backend = MooncakeBackend(cfg, unevicting_master.address, io_threads=1)
        if checksum:
            backend = ChecksummedBackend(backend)
        try:
            return await fill(backend)
        finally:
            await backend.close()

    plain = asyncio.run(run(checksum=False))
    checked = asyncio.run(run(checksum=True))
    assert plain == SEGMENT // BLOCK
    assert abs(checked - plain * 8 / 9) <= 2, (plain, checked)
