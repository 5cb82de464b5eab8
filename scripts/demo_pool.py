"""kvray Pool API, notebook style (each ``# %%`` is a cell; paste them into Jupyter).

Starts a local Ray cluster on loopback, a 2-rank pool with kvray's embedded
``mooncake_master``, stores and loads tensors, runs a prefix lookup the way the vLLM
connector does, prints the pool's counters, and stops everything it started.

    make demo-pool   # or: .venv/bin/python scripts/demo_pool.py [--json results.json]
    .venv/bin/python scripts/demo_pool.py --smoke   # the same with 8 blocks instead of 64
"""

# %% Start Ray on loopback and a pool (no master address configured -> embedded master)
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 only
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402

from kvray import KeySpace, KVLayout, Pool, PoolConfig, chain_block_hashes  # noqa: E402
from kvray.ray_env import ray_init  # noqa: E402


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


SMOKE = ["--blocks", "8"]
parser = argparse.ArgumentParser(description="kvray Pool API demo")
parser.add_argument("--blocks", type=int, default=64, help="zero-copy blocks of 512 KiB")
parser.add_argument("--json", type=Path, help="write what the demo found here")
parser.add_argument("--smoke", action="store_true", help=f"the same with {' '.join(SMOKE)}")
# parse_known_args: in a notebook, the kernel's own arguments are not the demo's.
args = parser.parse_known_args()[0]
if args.smoke:
    args = parser.parse_known_args([*SMOKE, *sys.argv[1:]])[0]
results: dict[str, Any] = {}


step("starting a local Ray cluster on 127.0.0.1")
t0 = time.monotonic()
ray_init("local", num_cpus=4)
print(f"   Ray up in {time.monotonic() - t0:.1f} s")

step("starting a 2-rank kvray pool (embedded mooncake_master)")
t0 = time.monotonic()
config = PoolConfig.from_dict(
    {
        "name": "demo",
        "world_size": 2,
        "detached": False,
        "mooncake": {"global_segment_size": "256MB", "local_buffer_size": "64MB"},
    },
    environ={},
)
pool = Pool.start(config)
print(f"   pool up in {time.monotonic() - t0:.1f} s; master at {pool.server_address}")

# %% Put and get tensors by key (numpy arrays or CPU torch tensors)
step("put / get by key")
weights = np.random.default_rng(0).standard_normal((4, 1024), dtype=np.float32)
pool.put(["layer0", "layer1"], [weights[:2], weights[2:]])
back = pool.get(["layer0", "layer1"], shape=(2, 1024), dtype=np.float32)
exact = all(np.array_equal(b, w) for b, w in zip(back, (weights[:2], weights[2:]), strict=True))
nobody = pool.get("nobody", shape=(4,))
print(f"   round trip byte-exact: {exact}")
print(f"   a key nobody stored: {nobody}")
results["by_key"] = {"byte_exact": exact, "missing_key_is_none": nobody is None}

# %% Zero-copy: tensors that live in shared memory the rank's actor maps
step("zero-copy blocks (Pool.empty)")
n = args.blocks
blocks = pool.empty((n, 512 << 10), np.uint8)  # n blocks of 512 KiB, in shared memory
blocks[:] = np.random.default_rng(1).integers(0, 256, blocks.shape, dtype=np.uint8)
t0 = time.monotonic()
pool.put([f"blk{i}" for i in range(n)], list(blocks), rank=0)
dt = time.monotonic() - t0
mib = blocks.nbytes >> 20
print(
    f"   stored {mib} MiB in one Ray call: {dt * 1e3:.0f} ms ({blocks.nbytes / dt / 1e9:.2f} GB/s)"
)
landing = pool.empty((n, 512 << 10), np.uint8)
pool.get([f"blk{i}" for i in range(n)], out=list(landing), rank=1)  # rank 1 reads rank 0's
zero_copy_exact = bool(np.array_equal(blocks, landing))
print(f"   rank 1 read rank 0's blocks byte-exact: {zero_copy_exact}")
results["zero_copy"] = {"blocks": n, "put_s": dt, "byte_exact": zero_copy_exact}

# %% Prefix lookup, as the connector's scheduler side does it
step("prefix lookup over block hashes (TP=2: a block counts only if both ranks have it)")
space = KeySpace("tiny-llama", KVLayout("float16", 16, 4, 64).tag(), tp_size=2)
system_prompt = list(range(1000, 1160))  # 10 blocks of 16 tokens
prompt_a = system_prompt + list(range(50))
prompt_b = system_prompt[:128] + list(range(7, 57))  # shares the first 8 blocks
hashes_a = chain_block_hashes(prompt_a, 16)
kv_block = np.zeros(2 * 16 * 4 * 64 * 2, np.uint8)  # one rank's K+V for one block
for tp_rank in range(2):
    pool.put([space.key(h, tp_rank) for h in hashes_a], [kv_block] * len(hashes_a), rank=tp_rank)
hashes_b = chain_block_hashes(prompt_b, 16)
hit_b = pool.lookup(space, hashes_b)
print(f"   prompt A: {len(hashes_a)} blocks stored by both ranks")
print(f"   prompt B: {hit_b} of {len(hashes_b)} leading blocks in the pool")
results["lookup"] = {"stored": len(hashes_a), "blocks": len(hashes_b), "hit": hit_b}


# %% Async twins, for notebooks and actors
step("async API")


async def async_part() -> None:
    await pool.aput("async-key", np.arange(10, dtype=np.int64))
    value = await pool.aget("async-key", shape=(10,), dtype=np.int64)
    hit = await pool.alookup(space, hashes_a)
    print(f"   aput/aget: {value.tolist()}")
    print(f"   alookup: {hit} blocks")
    results["async"] = {"value": value.tolist(), "lookup_hit": hit}


asyncio.run(async_part())

# %% Counters, the same ones `kvray status` prints
step("pool status")
stats = pool.stats()
print(stats.table())
results["pool"] = {"puts": stats.total.put_keys, "gets": stats.total.get_keys}

# %% Stop everything this demo started
step("shutting down")
pool.shutdown()
ray.shutdown()
print("   pool, embedded master and Ray stopped")
if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
