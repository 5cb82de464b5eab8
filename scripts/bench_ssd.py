"""SSD benchmark: kvray's SSD tier against raw file I/O of the same bytes on the same disk,
plus the DRAM-miss -> SSD-hit load path through a kvray pool.

One run measures, in one directory on the disk under test, every path live at once and
the reps interleaved (each rep runs every path in turn, order rotated: clear, write,
drop the page cache, read, verify byte-exact; one warm-up rep first):

- ``raw``: one file per block, ``os.write`` to a temp name + rename (as the tier does, so
  both leave whole files), read back with ``os.preadv``, one stream (``dd`` style);
- ``raw xN``: the same on ``N`` threads (``--threads``, the tier's ``io_threads``), the
  baseline at the tier's own parallelism; ``raw xN fsync``: each file fsynced before its
  rename (durable writes);
- ``kvray ssd`` / ``kvray ssd fsync``: the SSD tier itself (``SsdBackend``, in-process,
  ``io_threads`` streams: header + xxh3 + atomic rename on write, checksum checked on
  read), without and with its ``fsync`` option;
- ``kvray pipeline load`` (read only): ``Pool.get`` of blocks a previous pool stored
  through a ``mooncake|ssd`` pipeline, in a new pool whose DRAM is empty: every block is
  a DRAM miss served by the SSD tier (one Ray call, SSD actor reads into the shared
  region).

Before every read the files' pages are dropped from the page cache (``fsync`` +
``posix_fadvise(DONTNEED)`` per file, for every path alike), so reads hit the disk, not
memory. kvray is compared with the strongest raw path (writes: of the same durability).
Every rep is in the JSON.

    .venv/bin/python scripts/bench_ssd.py --json bench-results/bench_ssd.json
    .venv/bin/python scripts/bench_ssd.py --smoke --json /tmp/bench_ssd.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import log, parse, round_trips, write_json  # noqa: E402
from _engines import run_meta  # noqa: E402

SMOKE = ["--blocks", "16", "--block-kib", "64"]
"""``--smoke``: 1 MiB per path instead of 256 MiB, the same paths, reps and JSON keys."""


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


class RawFiles:
    """The baseline: one file per block, written to a temp name and renamed (optionally
    fsynced first), read with ``preadv``; on ``threads`` threads, contiguous slices."""

    def __init__(self, root: Path, threads: int, fsync: bool) -> None:
        self.root, self.fsync = root, fsync
        (root / "tmp").mkdir(parents=True)
        self.io = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        self.threads = threads

    def _split(self, n: int, fn: Callable[[int, int], None]) -> None:
        if self.io is None:
            fn(0, n)
            return
        bounds = [n * i // self.threads for i in range(self.threads + 1)]
        for f in [self.io.submit(fn, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]:
            f.result()

    def clear(self) -> None:
        for p in self.root.glob("*.blk"):
            p.unlink()

    def write(self, src: np.ndarray) -> None:
        def part(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                tmp = self.root / "tmp" / f"{i}.blk"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, memoryview(src[i]))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.root / f"{i}.blk")

        self._split(len(src), part)

    def read(self, dst: np.ndarray) -> None:
        block = dst.shape[1]

        def part(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                fd = os.open(self.root / f"{i}.blk", os.O_RDONLY)
                try:
                    assert os.preadv(fd, [memoryview(dst[i])], 0) == block
                finally:
                    os.close(fd)

        self._split(len(dst), part)

    def close(self) -> None:
        if self.io is not None:
            self.io.shutdown()


class Tier:
    """kvray's SSD tier in-process, as the SSD actor runs it."""

    def __init__(self, root: Path, src: np.ndarray, dst: np.ndarray, threads: int, fsync: bool):
        from kvray.backends.ssd import SsdBackend
        from kvray.config import SsdConfig

        blocks, block = src.shape
        root.mkdir()
        cfg = SsdConfig(path=str(root), quota=4 * src.nbytes, io_threads=threads, fsync=fsync)
        self.tier = SsdBackend(cfg, rank=0)
        self.keys = [f"bench-{i}" for i in range(blocks)]
        self.sp = [[int(src[i].ctypes.data)] for i in range(blocks)]
        self.dp = [[int(dst[i].ctypes.data)] for i in range(blocks)]
        self.sizes = [[block]] * blocks
        self.loop = asyncio.new_event_loop()

    def clear(self) -> None:
        self.loop.run_until_complete(self.tier.remove(self.keys))

    def write(self) -> None:
        from kvray.backends.base import KeyStatus

        got = self.loop.run_until_complete(self.tier.put(self.keys, self.sp, self.sizes))
        assert set(got) == {KeyStatus.OK}, set(got)

    def read(self) -> None:
        from kvray.backends.base import KeyStatus

        got = self.loop.run_until_complete(self.tier.get(self.keys, self.dp, self.sizes))
        assert set(got) == {KeyStatus.OK}, set(got)

    def close(self) -> None:
        self.loop.run_until_complete(self.tier.close())
        self.loop.close()


def start_pipeline(payload: np.ndarray, root: Path, threads: int) -> tuple[Any, Any, list[str]]:
    """A ``mooncake|ssd`` pool that stored ``payload``, shut down, and a fresh one on the
    same directory (its DRAM empty: every block is an SSD hit); returns it, its output
    array and the keys."""
    from kvray import Pool, PoolConfig
    from kvray.ray_env import ray_init

    blocks = payload.shape[0]
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
    with Pool.start(cfg) as pool:
        src = pool.empty(payload.shape, np.uint8)
        src[:] = payload
        for lo in range(0, blocks, 32):  # the 64 MB DRAM pool takes what fits
            try:
                pool.put(keys[lo : lo + 32], list(src[lo : lo + 32]))
            except Exception as exc:  # noqa: BLE001 - DRAM full is expected here
                log(f"   (DRAM refused part of a batch: {type(exc).__name__}; SSD has it)")
        pool.shutdown()
    pool = Pool.start(cfg)
    return pool, pool.empty(payload.shape, np.uint8), keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4, help="SSD tier io_threads")
    parser.add_argument("--dir", default="/var/tmp", help="a directory on the disk under test")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parse(parser, SMOKE)
    if args.reps < 3:
        parser.error("--reps must be >= 3 (medians of fewer are noise)")
    import ray

    blocks, block, n = args.blocks, args.block_kib << 10, args.threads
    payload = np.random.default_rng(0).integers(0, 256, (blocks, block), dtype=np.uint8)
    dst = np.zeros_like(payload)
    work = Path(tempfile.mkdtemp(prefix="kvray-bench-ssd-", dir=args.dir))
    log(
        f"== {blocks} blocks x {args.block_kib} KiB = {payload.nbytes >> 20} MiB in {work}; "
        f"{args.reps} reps (+1 warm-up), every path in turn per rep, order rotated"
    )
    raws = {
        "raw": RawFiles(work / "raw1", 1, fsync=False),
        f"raw x{n}": RawFiles(work / "rawn", n, fsync=False),
        f"raw x{n} fsync": RawFiles(work / "rawnf", n, fsync=True),
    }
    tiers = {
        "kvray ssd": Tier(work / "tier", payload, dst, n, fsync=False),
        "kvray ssd fsync": Tier(work / "tierf", payload, dst, n, fsync=True),
    }
    pool = None
    try:
        log("== kvray mooncake|ssd pipeline: storing, then a fresh pool (DRAM empty)")
        pool, out, keys = start_pipeline(payload, work / "pipeline", n)
        rows = list(out)

        def between(root: Path, into: np.ndarray) -> Callable[[], None]:
            """Before a read: the files' pages out of the cache, the destination zeroed."""

            def clear() -> None:
                drop_cache(root)
                into.fill(0)

            return clear

        def same(into: np.ndarray) -> Callable[[], bool]:
            return lambda: np.array_equal(into, payload)

        # name -> (clear, write or None, between, read, the destination holds the payload)
        paths: dict[str, Any] = {}
        for name, r in raws.items():
            w, rd = (lambda r=r: r.write(payload)), (lambda r=r: r.read(dst))
            paths[name] = (r.clear, w, between(r.root, dst), rd, same(dst))
        for name, t in tiers.items():
            paths[name] = (t.clear, t.write, between(t.tier.root, dst), t.read, same(dst))
        load = (between(work / "pipeline", out), lambda: pool.get(keys, out=rows))
        paths["kvray pipeline load"] = (lambda: None, None, *load, same(out))
        times = round_trips(paths, args.reps, ("write", "read"))
        ssd_gets = pool.stats().total.ssd_get_keys
        if ssd_gets < blocks * (args.reps + 1):
            raise RuntimeError(
                f"pipeline load: the SSD tier served {ssd_gets} keys, expected "
                f">= {blocks * (args.reps + 1)}: the loads did not come from SSD"
            )
    finally:
        for r in raws.values():
            r.close()
        for t in tiers.values():
            t.close()
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    nbytes = payload.nbytes
    gbps = {
        x: {op: nbytes / statistics.median(t[op]) / 1e9 for op in ("write", "read") if t[op]}
        for x, t in times.items()
    }

    def vs(name: str, op: str) -> str:
        if op not in gbps[name]:
            return ""
        durable = "fsync" in name
        base = [x for x in times if x.startswith("raw") and ("fsync" in x) == durable]
        if op == "read":
            base = [x for x in times if x.startswith("raw")]
        return f"{gbps[name][op] / max(gbps[x][op] for x in base):.2f}"

    print()
    print(f"{'path':<22}{'write GB/s':>13}{'read GB/s':>13}{'w/raw':>7}{'r/raw':>7}")
    for x in times:
        cells = []
        for op in ("write", "read"):
            reps = times[x][op]
            if not reps:
                cells.append("")
                continue
            half = (max(reps) - min(reps)) / statistics.median(reps) / 2
            cells.append(f"{gbps[x][op]:>7.2f} ±{half:3.0%}")
        rel = f"{vs(x, 'write'):>7}{vs(x, 'read'):>7}" if x.startswith("kvray") else ""
        print(f"{x:<22}{cells[0]:>13}{cells[1]:>13}{rel}")
    print(
        f"\nmedians of {args.reps}, ± half the range of the reps; vs raw = against the "
        "strongest raw path (writes: of the same durability, fsync or not)"
    )
    results = {
        "meta": run_meta(
            order="per rep every path in turn (clear, write, drop cache, read, verify), "
            "order rotated",
            reps=args.reps,
        ),
        "gbps": gbps,
        "reps_s": times,
        "params": {"blocks": blocks, "block_bytes": block, "threads": n, "dir": args.dir},
    }
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
