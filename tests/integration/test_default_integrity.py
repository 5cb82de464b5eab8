"""With the default config a block whose stored bytes changed inside the pool is a miss or
an error, never served: a flipped byte written back under the same key by a
raw client of the backend (kvray's adapter without the checksum wrapper), on the real
Mooncake master, the real datasystem worker, and in a block file of the SSD tier."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from kvray import Pool
from kvray.backends.base import KeyStatus
from kvray.backends.checksum import TRAILER
from kvray.backends.registry import spec_of
from kvray.errors import TransferError

from .conftest import small_config, ssd_pool_config

pytestmark = pytest.mark.integration
BLOCK = 256 << 10


def _value(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def _get_or_none(pool: Pool, key: str) -> np.ndarray | None:
    """What the pool serves for ``key``: the bytes, None (a miss) or TransferError."""
    return pool.get(key, out=np.empty(BLOCK, np.uint8))


async def _flip_one_byte(pool: Pool, key: str, at: int) -> None:
    """Read ``key``'s stored value (the block, and its trailer when checksums are on) with
    a raw client, flip one byte of the block, and write it back under the same key."""
    raw = spec_of(pool.config.backend).make_client(pool.config, pool.server_address, False)
    buf = np.zeros(BLOCK + (TRAILER if pool.config.checksum else 0), np.uint8)
    await raw.register_region(buf.ctypes.data, buf.nbytes)
    try:
        (st,) = await raw.get([key], [[buf.ctypes.data]], [[buf.nbytes]])
        assert st is KeyStatus.OK, f"the raw client reads the stored value: {st}"
        buf[at] ^= 0x01
        (st,) = await raw.put([key], [[buf.ctypes.data]], [[buf.nbytes]], overwrite=True)
        assert st is KeyStatus.OK, st
    finally:
        await raw.unregister_region(buf.ctypes.data)
        await raw.close()


@pytest.mark.parametrize("backend", ["mooncake", "yuanrong"])
def test_a_flipped_byte_is_never_served_with_the_default_config(ray_cluster, request, backend):
    if backend == "mooncake":
        cfg = small_config(request.getfixturevalue("mooncake_master").address)
    else:
        cfg = small_config(None, backend="yuanrong")
    assert cfg.checksum, "checksums are on by default"
    with Pool.start(cfg) as pool:
        value = _value(1)
        key = f"{cfg.name}-flip"
        pool.put(key, value)
        got = _get_or_none(pool, key)
        assert got is not None and np.array_equal(got, value)
        asyncio.run(_flip_one_byte(pool, key, at=BLOCK // 3))
        try:
            served = _get_or_none(pool, key)
        except TransferError as exc:
            assert "corrupt" in str(exc)
        else:
            assert served is None, "a block with a flipped byte was served"
        # removed once caught: the next lookup misses instead of failing again
        assert pool.exists([key]) == [False]
        assert pool.stats().total.get_corrupt == 1
        pool.shutdown()


def test_a_flipped_byte_in_an_ssd_block_is_never_served(ray_cluster, tmp_path):
    cfg = ssd_pool_config(tmp_path, "ssdflip")
    assert cfg.checksum
    with Pool.start(cfg) as pool:
        value = _value(2)
        pool.put("ssdflip-x", value)
        files: list[Path] = []
        deadline = time.monotonic() + 30
        while not files and time.monotonic() < deadline:  # in case the SSD write lags
            files = sorted((tmp_path / "rank_0" / "blocks").glob("*/*.blk"))
            time.sleep(0.05)
        assert len(files) == 1, files
        # Only the SSD copy is left: DRAM's is removed behind the pool's back.
        raw = spec_of(cfg.backend).make_client(cfg, pool.server_address, False)
        assert asyncio.run(raw.remove(["ssdflip-x"], force=True)) == [KeyStatus.OK]
        asyncio.run(raw.close())
        data = bytearray(files[0].read_bytes())
        data[-BLOCK // 2] ^= 0x01  # inside the block's bytes, not its header
        files[0].write_bytes(bytes(data))
        try:
            served = _get_or_none(pool, "ssdflip-x")
        except TransferError as exc:
            assert "corrupt" in str(exc)
        else:
            assert served is None, "an SSD block with a flipped byte was served"
        assert pool.stats().total.ssd_corrupt >= 1
        pool.shutdown()
