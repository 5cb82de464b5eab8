"""kvray's SSD tier on real files on the real disk: round trips, quota and each eviction
policy, restart, corruption, crash leftovers, path checks, direct I/O."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from kvray.backends.base import KeyStatus
from kvray.backends.ssd import ALIGN, SsdBackend
from kvray.config import SsdConfig
from kvray.errors import ConfigError

BLOCK = 64 << 10


def tier(path, **kw) -> SsdBackend:
    return SsdBackend(SsdConfig(path=str(path), **{"quota": "4MB", "io_threads": 2, **kw}), 0)


def rows(a: np.ndarray, pieces: int = 1):
    step = a.shape[1] // pieces
    return (
        [[r.ctypes.data + p * step for p in range(pieces)] for r in a],
        [[step] * pieces for _ in a],
    )


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def run(coro):
    return asyncio.run(coro)


def test_round_trip_multi_piece_and_first_write_wins(tmp_path):
    t = tier(tmp_path)
    src, dst = data(4), np.zeros((4, BLOCK), np.uint8)
    keys = [f"k{i}" for i in range(4)]
    assert run(t.put(keys, *rows(src, 4))) == [KeyStatus.OK] * 4
    other = data(1, 9)
    assert run(t.put(keys[:1], *rows(other))) == [KeyStatus.OK]  # kept the first
    assert run(t.get(keys, *rows(dst, 2))) == [KeyStatus.OK] * 4
    assert np.array_equal(src, dst)
    files = list((tmp_path / "rank_0" / "blocks").glob("*/*.blk"))
    assert len(files) == 4 and not any((tmp_path / "rank_0" / "tmp").iterdir())
    assert run(t.get(["nope"], *rows(dst[:1]))) == [KeyStatus.NOT_FOUND]
    assert run(t.get(keys[:1], [[dst.ctypes.data]], [[BLOCK // 2]])) == [KeyStatus.SIZE_MISMATCH]


@pytest.mark.parametrize("policy", ["none", "fifo", "lru"])
def test_quota_and_eviction_policies(tmp_path, policy):
    # 4 MB quota holds 60 blocks of 64 KiB + 4 KiB headers; write 66 (6 too many).
    t = tier(tmp_path, eviction=policy)
    src = data(66, 1)
    keys = [f"b{i}" for i in range(66)]

    def put_each(indexes: range) -> list[KeyStatus]:
        # One at a time: a batch's blocks are written by 2 I/O threads, so their age order
        # is the order the writes end in (under load, not the keys' order).
        return [run(t.put([keys[i]], *rows(src[i : i + 1])))[0] for i in indexes]

    first = put_each(range(10))
    assert first == [KeyStatus.OK] * 10
    if policy == "lru":  # touch b0: the least recently used are now b1..
        out = np.zeros((1, BLOCK), np.uint8)  # alive while the tier writes into it
        assert run(t.get(["b0"], *rows(out))) == [KeyStatus.OK]
    statuses = put_each(range(10, 66))
    present = run(t.exists(keys))
    assert t.usage()["used_bytes"] <= 4 << 20
    if policy == "none":
        assert KeyStatus.POOL_FULL in statuses and all(present[:10])
        assert not present[-1] and t.stats.full > 0 and t.stats.evictions == 0
    else:
        assert set(statuses) == {KeyStatus.OK} and all(present[-50:]) and t.stats.evictions == 6
        if policy == "fifo":
            assert not present[0]
        else:
            assert present[0] and not present[1]


def test_restart_rebuilds_the_index_and_serves_the_same_bytes(tmp_path):
    t = tier(tmp_path, eviction="fifo")
    src = data(5, 2)
    keys = [f"r{i}" for i in range(5)]
    run(t.put(keys, *rows(src)))
    run(t.close())
    again = tier(tmp_path, eviction="fifo")
    assert run(again.exists(keys)) == [True] * 5
    assert again.usage() == t.usage()
    dst = np.zeros_like(src)
    assert run(again.get(keys, *rows(dst))) == [KeyStatus.OK] * 5
    assert np.array_equal(src, dst)
    # FIFO order survives: the oldest goes first.
    big = data(70, 3)
    run(again.put([f"n{i}" for i in range(70)], *rows(big)))
    assert not run(again.exists(["r0"]))[0]


def test_corrupted_block_is_a_miss_and_is_removed(tmp_path):
    t = tier(tmp_path)
    src = data(2, 4)
    run(t.put(["good", "bad"], *rows(src)))
    path = t._path("bad")
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 10)
    dst = np.zeros_like(src)
    assert run(t.get(["good", "bad"], *rows(dst))) == [KeyStatus.OK, KeyStatus.NOT_FOUND]
    assert not path.exists() and run(t.exists(["bad"])) == [False]
    assert t.stats.corrupt == 1 and np.array_equal(dst[0], src[0])


def test_crash_leftovers_are_never_visible(tmp_path):
    t = tier(tmp_path)
    whole = data(1, 5)
    run(t.put(["whole"], *rows(whole)))
    run(t.close())
    root = tmp_path / "rank_0"
    # a crash between write and rename: a temp file; and a torn file in place
    (root / "tmp" / "x.blk.1.1").write_bytes(b"half a block")
    torn = t._path("torn")
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(t._path("whole").read_bytes()[:1000])
    again = tier(tmp_path)
    assert run(again.exists(["whole", "torn"])) == [True, False]
    assert not any((root / "tmp").iterdir()) and not torn.exists()


def test_path_checks(tmp_path):
    with pytest.raises(ValueError, match="absolute path"):
        SsdConfig(path="relative/dir")
    with pytest.raises(ConfigError, match="does not exist"):
        tier(tmp_path / "missing")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="symlink"):
        tier(link)
    with pytest.raises(ConfigError, match="lower the quota"):
        tier(tmp_path, quota="1000TB")


def test_direct_io_with_aligned_memory(tmp_path):
    t = tier(tmp_path, direct_io=True)
    raw = np.zeros(3 * BLOCK + ALIGN, np.uint8)
    base = (-raw.ctypes.data) % ALIGN
    src = raw[base : base + 2 * BLOCK].reshape(2, BLOCK)
    src[:] = data(2, 6)
    assert run(t.put(["d0", "d1"], *rows(src))) == [KeyStatus.OK] * 2
    assert t._index["d0"].offset % ALIGN == 0
    dst = np.zeros((2, BLOCK), np.uint8)
    assert run(t.get(["d0", "d1"], *rows(dst))) == [KeyStatus.OK] * 2
    assert np.array_equal(src, dst)


def test_lru_order_survives_restart(tmp_path):
    t = tier(tmp_path, eviction="lru")
    src = data(3, 7)
    run(t.put(["a", "b", "c"], *rows(src)))
    time.sleep(0.02)
    out = np.zeros((1, BLOCK), np.uint8)
    run(t.get(["a"], *rows(out)))
    run(t.close())
    again = tier(tmp_path, eviction="lru")
    assert list(again._index) == ["b", "c", "a"]


# ---- Mooncake's native offload: configuration ------------------------------------------


def test_offload_env_takes_byte_literals_only(tmp_path):
    from kvray.config import MooncakeConfig

    base = {"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "10G"}
    with pytest.raises(ConfigError, match="TOTAL_SIZE_LIMIT_BYTES must be a plain number"):
        MooncakeConfig.from_env(base)
    with pytest.raises(ConfigError, match="bucket_eviction_policy: Input should be 'none'"):
        MooncakeConfig.from_env({"MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "random"})
    cfg = MooncakeConfig.from_env(
        {"MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": "1342177280",
         "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru"}
    )  # fmt: skip
    assert cfg.offload.env() == {
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": "1342177280",
        "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru",
    }


def test_offload_path_and_quota_checks(tmp_path):
    from kvray.config import MooncakeConfig, MooncakeMasterConfig, PoolConfig

    def load(**kw):
        return MooncakeConfig.model_validate({"protocol": "tcp", "enable_ssd_offload": True, **kw})

    with pytest.raises(ValueError, match="needs ssd_offload_path"):
        load()
    with pytest.raises(ValueError, match="absolute path without '..'"):
        load(ssd_offload_path=str(tmp_path) + "/../x")
    with pytest.raises(ValueError, match="does not exist"):
        load(ssd_offload_path=str(tmp_path / "nope"))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symlink"):
        load(ssd_offload_path=str(tmp_path / "link"))
    with pytest.raises(ValueError, match="larger than the disk"):
        load(ssd_offload_path=str(tmp_path), offload={"total_size_limit_bytes": 1 << 60})
    assert load(ssd_offload_path=str(tmp_path)).enable_ssd_offload
    from kvray.servers.mooncake_master import MooncakeMaster

    cmd = MooncakeMaster(MooncakeMasterConfig(enable_offload=True), tmp_path).command()
    assert "--enable_offload=true" in cmd
    with pytest.raises(ConfigError, match="needs an ssd section"):
        PoolConfig.from_dict({"pipeline": "mooncake|ssd"}, environ={})
