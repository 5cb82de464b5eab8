"""SSD benchmark: kvray's SSD tier against raw file I/O of the same bytes on the same disk,
plus the DRAM-miss -> SSD-hit load path through a kvray pool.

One run measures, in one directory on the disk under test:

- ``raw``: one file per block, ``os.write`` to a temp name + rename (as the tier does, so
  both leave whole files), read back with ``os.preadv`` (the ``dd``-style baseline);
- ``kvray ssd``: the SSD tier itself (``SsdBackend``, in-process, ``io_threads`` streams:
  header + crc32 + atomic rename on write, crc32 check on read);
- ``kvray pipeline load``: ``Pool.get`` of blocks a previous pool stored through a
  ``mooncake|ssd`` pipeline, in a new pool whose DRAM is empty: every block is a DRAM miss
  served by the SSD tier (one Ray call, SSD actor reads into the shared region).

Before every read repetition the files' pages are dropped from the page cache
(``fsync`` + ``posix_fadvise(DONTNEED)`` per file, for raw and kvray alike), so reads hit
the disk, not memory. Medians of ``--reps`` after one warm-up.

    .venv/bin/python scripts/bench_ssd.py --json bench-results/bench_ssd.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import numpy as np  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(name: str, reps: int, setup: Callable[[], object], run: Callable[[], object]) -> float:
    """Median seconds of ``reps`` runs after one warm-up, each after ``setup``."""
    times = []
    for rep in range(reps + 1):
        setup()
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        if rep:
            times.append(dt)
        log(f"   {name:<22} rep {rep}/{reps}{' (warm-up)' if rep == 0 else ''}: {dt * 1e3:8.1f} ms")
    return statistics.median(times)


def drop_cache(root: Path) -> None:
    """Push the files under ``root`` to disk and drop their pages from the page cache."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_raw(src: np.ndarray, dst: np.ndarray, root: Path, reps: int) -> tuple[float, float]:
    blocks, block = src.shape
    root.mkdir()
    (root / "tmp").mkdir()

    def clear() -> None:
        for p in root.glob("*.blk"):
            p.unlink()

    def write() -> None:
        for i in range(blocks):
            tmp = root / "tmp" / f"{i}.blk"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, memoryview(src[i]))
            finally:
                os.close(fd)
            os.replace(tmp, root / f"{i}.blk")

    def read() -> None:
        for i in range(blocks):
            fd = os.open(root / f"{i}.blk", os.O_RDONLY)
            try:
                assert os.preadv(fd, [memoryview(dst[i])], 0) == block
            finally:
                os.close(fd)

    w = measure("raw write", reps, clear, write)
    r = measure("raw read", reps, lambda: drop_cache(root), read)
    assert np.array_equal(src, dst), "raw round trip is not byte-exact"
    n = src.nbytes
    return n / w / 1e9, n / r / 1e9


def bench_tier(
    src: np.ndarray, dst: np.ndarray, root: Path, reps: int, threads: int
) -> tuple[float, float]:
    from kvray.backends.base import KeyStatus
    from kvray.backends.ssd import SsdBackend
    from kvray.config import SsdConfig

    blocks, block = src.shape
    root.mkdir()
    cfg = SsdConfig(path=str(root), quota=4 * src.nbytes, io_threads=threads)
    tier = SsdBackend(cfg, rank=0)
    keys = [f"bench-{i}" for i in range(blocks)]
    sp = [[int(src[i].ctypes.data)] for i in range(blocks)]
    dp = [[int(dst[i].ctypes.data)] for i in range(blocks)]
    sizes = [[block]] * blocks
    loop = asyncio.new_event_loop()

    def clear() -> None:
        loop.run_until_complete(tier.remove(keys))

    def write() -> None:
        got = loop.run_until_complete(tier.put(keys, sp, sizes))
        assert set(got) == {KeyStatus.OK}, set(got)

    def read() -> None:
        got = loop.run_until_complete(tier.get(keys, dp, sizes))
        assert set(got) == {KeyStatus.OK}, set(got)

    w = measure("kvray ssd write", reps, clear, write)
    r = measure("kvray ssd read", reps, lambda: drop_cache(root), read)
    assert np.array_equal(src, dst), "kvray ssd round trip is not byte-exact"
    loop.run_until_complete(tier.close())
    loop.close()
    n = src.nbytes
    return n / w / 1e9, n / r / 1e9


def bench_pipeline(payload: np.ndarray, root: Path, reps: int, threads: int) -> float:
    """Pool.get of blocks that only the SSD tier holds (a fresh pool: DRAM is empty)."""
    import ray

    from kvray import Pool, PoolConfig
    from kvray.ray_env import ray_init

    blocks, block = payload.shape
    root.mkdir()
    ray_init("local", num_cpus=2)
    cfg = PoolConfig.from_dict(
        {
            "name": "benchssd",
            "world_size": 1,
            "detached": False,
            "transfer_window_size": "64MB",
            "pipeline": "mooncake|ssd",
            "ssd": {"path": str(root), "quota": 4 * payload.nbytes, "io_threads": threads},
            "mooncake": {"global_segment_size": "64MB", "local_buffer_size": "64MB"},
        },
        environ={},
    )
    keys = [f"pipe-{i}" for i in range(blocks)]
    try:
        with Pool.start(cfg) as pool:
            src = pool.empty(payload.shape, np.uint8)
            src[:] = payload
            for lo in range(0, blocks, 32):  # the 64 MB DRAM pool takes what fits
                try:
                    pool.put(keys[lo : lo + 32], list(src[lo : lo + 32]))
                except Exception as exc:  # noqa: BLE001 - DRAM full is expected here
                    log(f"   (DRAM refused part of a batch: {type(exc).__name__}; SSD has it)")
            pool.shutdown()
        with Pool.start(cfg) as pool:
            out = pool.empty(payload.shape, np.uint8)
            rows = list(out)
            t = measure(
                "kvray pipeline load",
                reps,
                lambda: drop_cache(root),
                lambda: pool.get(keys, out=rows),
            )
            assert np.array_equal(out, payload), "pipeline load is not byte-exact"
            assert pool.stats().total.ssd_get_keys >= blocks
            pool.shutdown()
    finally:
        ray.shutdown()
    return payload.nbytes / t / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4, help="SSD tier io_threads")
    parser.add_argument("--dir", default="/var/tmp", help="a directory on the disk under test")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args()
    if args.reps < 3:
        parser.error("--reps must be >= 3 (medians of fewer are noise)")
    blocks, block = args.blocks, args.block_kib << 10
    payload = np.random.default_rng(0).integers(0, 256, (blocks, block), dtype=np.uint8)
    work = Path(tempfile.mkdtemp(prefix="kvray-bench-ssd-", dir=args.dir))
    log(f"== {blocks} blocks x {args.block_kib} KiB = {payload.nbytes >> 20} MiB in {work}")
    try:
        log("== raw file I/O (one file per block, write + rename, preadv)")
        raw_w, raw_r = bench_raw(payload, np.zeros_like(payload), work / "raw", args.reps)
        log(f"== kvray SSD tier ({args.threads} streams)")
        ssd_w, ssd_r = bench_tier(
            payload, np.zeros_like(payload), work / "tier", args.reps, args.threads
        )
        log("== kvray mooncake|ssd pipeline: DRAM miss -> SSD hit through Pool.get")
        pipe = bench_pipeline(payload, work / "pipeline", args.reps, args.threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "gbps": {
            "kvray_ssd_write": ssd_w,
            "kvray_ssd_read": ssd_r,
            "raw_write": raw_w,
            "raw_read": raw_r,
            "kvray_pipeline_ssd_load": pipe,
        },
        "params": {
            "blocks": blocks,
            "block_bytes": block,
            "reps": args.reps,
            "threads": args.threads,
            "dir": args.dir,
            "cpus": os.cpu_count(),
        },
    }
    print()
    print(f"{'path':<30}{'write GB/s':>11}{'read GB/s':>11}{'w/raw':>7}{'r/raw':>7}")
    print(f"{'raw file I/O (baseline)':<30}{raw_w:>11.2f}{raw_r:>11.2f}{1:>7.2f}{1:>7.2f}")
    print(
        f"{'kvray SSD tier':<30}{ssd_w:>11.2f}{ssd_r:>11.2f}"
        f"{ssd_w / raw_w:>7.2f}{ssd_r / raw_r:>7.2f}"
    )
    print(f"{'kvray pipeline, DRAM miss':<30}{'':>11}{pipe:>11.2f}{'':>7}{pipe / raw_r:>7.2f}")
    print(
        f"\ntarget >= 0.7x raw: write {ssd_w / raw_w:.2f}x, read {ssd_r / raw_r:.2f}x; "
        f"pipeline load {pipe / raw_r:.2f}x raw read"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
