#!/usr/bin/env python
"""What a worker's per-step call to its node's BackendClient costs: the node channel
(kvray.store.channel, the default ``transfer_channel: node``) against a Ray actor call (the
fallback, and what every transfer was before), on the same actor of a real pool.

Three shapes, each a round trip as the engine's worker sees it:

- ``empty``: a call with nothing to do (the channel's ``ping``; Ray's ``probe``);
- ``get``: a step's load of N blocks of ``--block-kib`` (a ``TransferBatch`` of N keys
  into a shared region, the blocks stored once before; checksums on, the default), so the
  backend's own time is inside both arms;
- ``put``: a step's save of the same N blocks (overwriting);

and the floor any same-node channel pays: a bare round trip between two processes over a
socketpair (one wake-up each way), in the same run.

Reps are interleaved (each rep runs every arm in turn, order rotated) and every rep is
recorded; the table gives p50/p99 and the median of per-rep paired differences
channel - Ray with its 95 % interval. Also measured: the BackendClient process's CPU
over ``--idle-s`` seconds with a channel attached and no calls (a bound on what the
idle channel costs: it includes Ray's own threads in that process; the worker's end has
no thread at all and blocks in the kernel only while it waits for an answer).

    python scripts/bench_channel.py --reps 300 --json bench-results/bench_channel.json
    python scripts/bench_channel.py --smoke      # the same run, 20 reps of 4 blocks
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import log, parse, write_json
from _engines import bench_pool, run_meta
from _stats import paired_difference_ms

SMOKE = ["--reps", "20", "--blocks", "4", "--idle-s", "1"]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300, help="round trips per arm")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per get/put")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle CPU measured over")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parse(parser, SMOKE)
    if args.reps < 10:
        parser.error("--reps must be >= 10")

    import psutil
    import ray

    from kvray.backends.base import KeyStatus
    from kvray.ray_env import ray_init
    from kvray.remote import Call
    from kvray.store.channel import ChannelStore
    from kvray.transfer import TransferBatch

    blocks, block = args.blocks, args.block_kib << 10
    # The floor: a bare round trip between two processes over a socketpair (a wake-up
    # each way), forked before Ray starts; it echoes until the socket closes.
    ours, theirs = socket.socketpair()
    echo = os.fork()
    if echo == 0:
        ours.close()
        while data := theirs.recv(64):
            theirs.sendall(data)
        os._exit(0)
    theirs.close()

    def floor() -> None:
        ours.sendall(b"p")
        ours.recv(64)

    log("== local Ray on loopback, a 1-rank pool (embedded master, checksums on)")
    ray_init("local", num_cpus=2)
    pool = bench_pool("bench-channel", "256MB", "64MB")
    try:
        handle = pool._loop.run(pool._actor(0))  # noqa: SLF001 - rank 0's BackendClient
        pid = int(handle.probe().result(60)["pid"])
        src = pool.empty(blocks * block, np.uint8)
        src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
        found = pool._region_of(src)  # noqa: SLF001 - the connector's descriptors
        assert found is not None
        spec = found[0].spec
        batch = TransferBatch.contiguous(
            spec, [f"ch-{i}" for i in range(blocks)], [i * block for i in range(blocks)],
            [block] * blocks,
        )  # fmt: skip
        channel = ChannelStore(handle, 60)
        channel.attach()
        if not channel.attached:
            log("the node channel did not attach (see the warning above)")
            return 1
        live = channel._live()  # noqa: SLF001 - the client, for the empty call
        assert live is not None
        statuses = handle.put(batch, True).result(60)
        assert all(s is KeyStatus.OK for s in statuses), statuses

        def ok(call: Call[list[KeyStatus]]) -> None:
            out = call.result(60)
            assert all(s is KeyStatus.OK for s in out), out

        arms: dict[tuple[str, str], Callable[[], object]] = {
            ("empty", "ray"): lambda: handle.probe().result(60),
            ("empty", "channel"): lambda: live.call("ping", (), "ping").result(60),
            ("get", "ray"): lambda: ok(handle.get(batch)),
            ("get", "channel"): lambda: ok(channel.get(batch)),
            ("put", "ray"): lambda: ok(handle.put(batch, True)),
            ("put", "channel"): lambda: ok(channel.put(batch, True)),
        }
        arms[("floor", "socketpair")] = floor
        for fn in arms.values():  # warm-up
            for _ in range(5):
                fn()
        names = list(arms)
        times: dict[tuple[str, str], list[float]] = {k: [] for k in names}
        log(f"== {args.reps} reps x {len(names)} arms, interleaved, order rotated")
        for rep in range(args.reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - t0)
            if (rep + 1) % max(1, args.reps // 5) == 0:
                log(f"   rep {rep + 1}/{args.reps}")
        frames = channel.frames

        log(f"== idle: the actor's CPU over {args.idle_s:g} s with the channel attached")
        proc = psutil.Process(pid)
        c0 = sum(proc.cpu_times()[:2])
        time.sleep(args.idle_s)
        idle_pct = (sum(proc.cpu_times()[:2]) - c0) / args.idle_s * 100
        channel.close()
    finally:
        pool.shutdown()
        ray.shutdown()
        ours.close()
        os.waitpid(echo, 0)

    floor_t = times.pop(("floor", "socketpair"))
    names.remove(("floor", "socketpair"))
    shapes = sorted({s for s, _ in names}, key=[s for s, _ in names].index)
    rows: list[dict[str, Any]] = []
    shape_of = f"{args.reps} reps; {blocks} x {args.block_kib} KiB"
    print(f"\nround trip as a worker sees it, ms ({shape_of})")
    print(f"{'call':<10} {'Ray p50':>8} {'p99':>7} {'channel p50':>12} {'p99':>7} "
          f"{'channel - Ray (median, 95% CI)':>32}")  # fmt: skip
    for shape in shapes:
        ray_t, ch_t = times[(shape, "ray")], times[(shape, "channel")]
        diff = paired_difference_ms(ch_t, ray_t)
        row: dict[str, Any] = {
            "call": shape,
            "ray_ms": {"p50": _pct(ray_t, 50), "p99": _pct(ray_t, 99)},
            "channel_ms": {"p50": _pct(ch_t, 50), "p99": _pct(ch_t, 99)},
            "channel_minus_ray_ms": {k: diff[k] for k in ("median", "ci95", "pairs")},
            "reps_s": {"ray": ray_t, "channel": ch_t},
        }
        rows.append(row)
        lo, hi = diff["ci95"]
        print(
            f"{shape:<10} {row['ray_ms']['p50']:8.3f} {row['ray_ms']['p99']:7.3f} "
            f"{row['channel_ms']['p50']:12.3f} {row['channel_ms']['p99']:7.3f} "
            f"{diff['median']:+14.3f} [{lo:+.3f}, {hi:+.3f}]"
        )
    print(f"floor: a bare socketpair round trip between two processes, p50 "
          f"{_pct(floor_t, 50):.3f} p99 {_pct(floor_t, 99):.3f}")  # fmt: skip
    print(f"\nchannel frames sent: {frames}; the BackendClient's CPU while idle: "
          f"{idle_pct:.2f} % of a core")  # fmt: skip
    write_json(
        args.json,
        {
            **run_meta(),
            "args": vars(args) | {"json": str(args.json) if args.json else None},
            "rows": rows,
            "floor_ms": {"p50": _pct(floor_t, 50), "p99": _pct(floor_t, 99), "reps_s": floor_t},
            "frames": frames,
            "idle_cpu_pct": idle_pct,
            "median_ms": {f"{s}/{a}": statistics.median(v) * 1e3 for (s, a), v in times.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
