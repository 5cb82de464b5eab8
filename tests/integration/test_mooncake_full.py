"""A Mooncake pool that stays full, as a cache does: the master evicts asynchronously, so
a burst of puts into the full pool finds no room until an eviction round ran. The adapter
puts those keys again once it has, so the burst is stored and nothing of it is dropped."""

from __future__ import annotations

import asyncio

import numpy as np

from kvray.backends.base import KeyStatus
from kvray.backends.mooncake import MooncakeBackend
from kvray.config import MooncakeConfig

MB = 1 << 20


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
