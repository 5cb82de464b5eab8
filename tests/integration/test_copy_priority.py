"""Mooncake's own copy thread runs at the save niceness while no load is in flight, and at
its own while one is: a real client against a real mooncake_master."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvray.backends import copy_thread
from kvray.backends.base import KeyStatus
from kvray.config import MooncakeConfig

from .backends import addr, blocks

pytestmark = pytest.mark.integration


def _client(master, save_niceness: int):  # type: ignore[no-untyped-def]
    from kvray.backends.mooncake import MooncakeBackend

    cfg = MooncakeConfig(global_segment_size=128 << 20, local_buffer_size=16 << 20, protocol="tcp")
    return MooncakeBackend(cfg, master.address, io_threads=2, save_niceness=save_niceness)


def test_a_stores_copy_yields_and_a_loads_does_not(mooncake_master):
    own = os.getpriority(os.PRIO_PROCESS, 0)  # (the setup's threads start at this thread's)
    client = _client(mooncake_master, save_niceness=19)

    async def main() -> None:
        src = blocks(64, 512 << 10, seed=1)  # 32 MiB: enough to tell which thread copies
        keys = [f"copy-prio-{i}" for i in range(len(src))]
        ptrs, sizes = addr(src)
        await client.register_region(src.ctypes.data, src.nbytes)
        assert await client.put(keys, ptrs, sizes) == [KeyStatus.OK] * len(keys)
        tid = client._copier.tid
        assert tid is not None, "the store's copy thread was not found"
        assert tid != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19
        assert client.info()["copy_thread"] == tid

        # the thread found is the one that copies: a second store runs on it
        more = blocks(64, 512 << 10, seed=2)
        await client.register_region(more.ctypes.data, more.nbytes)
        before = copy_thread.run_ns([tid])[tid]
        mptrs, msizes = addr(more)
        more_keys = [f"copy-prio-more-{i}" for i in range(len(more))]
        assert await client.put(more_keys, mptrs, msizes) == [KeyStatus.OK] * len(keys)
        assert copy_thread.run_ns([tid])[tid] - before >= copy_thread.MIN_CPU_NS

        dst = np.zeros_like(src)
        await client.register_region(dst.ctypes.data, dst.nbytes)
        during: list[int] = []

        def check(a: int, b: int, statuses: list[KeyStatus]) -> list[KeyStatus]:
            during.append(os.getpriority(os.PRIO_PROCESS, tid))
            return statuses

        dptrs, dsizes = addr(dst)
        assert await client.get(keys, dptrs, dsizes, check=check) == [KeyStatus.OK] * len(keys)
        assert during and set(during) == {own}, during
        assert np.array_equal(dst, src)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19
        await client.remove(keys + more_keys, force=True)

    try:
        asyncio.run(main())
    finally:
        asyncio.run(client.close())


def test_niceness_0_leaves_the_copy_thread_alone(mooncake_master):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    client = _client(mooncake_master, save_niceness=0)

    async def main() -> None:
        src = blocks(64, 512 << 10, seed=3)
        keys = [f"copy-prio-zero-{i}" for i in range(len(src))]
        await client.register_region(src.ctypes.data, src.nbytes)
        assert await client.put(keys, *addr(src)) == [KeyStatus.OK] * len(keys)
        assert client._copier.tid is None and client.info()["copy_thread"] is None
        reniced = []
        assert client._copier.candidates
        for tid in client._copier.candidates:  # (the threads Mooncake's setup started)
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) != own:
                    reniced.append(tid)
            except OSError:  # (ended meanwhile)
                pass
        assert reniced == []
        await client.remove(keys, force=True)

    try:
        asyncio.run(main())
    finally:
        asyncio.run(client.close())
