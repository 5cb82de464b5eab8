"""kvray Pool API, notebook style (each ``# %%`` is a cell; paste them into Jupyter).

Starts a local Ray cluster on loopback, a 2-rank pool with kvray's embedded
``mooncake_master``, stores and loads tensors, runs a prefix lookup the way the vLLM
connector does, prints the pool's counters, and stops everything it started.

    make demo        # or: .venv/bin/python scripts/demo_pool.py
"""

# %% Start Ray on loopback and a pool (no master address configured -> embedded master)
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 only
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import asyncio  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402

from kvray import KeySpace, KVLayout, Pool, PoolConfig, chain_block_hashes  # noqa: E402
from kvray.ray_env import ray_init  # noqa: E402


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


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
print(f"   round trip byte-exact: {exact}")
print(f"   a key nobody stored: {pool.get('nobody', shape=(4,))}")

# %% Zero-copy: tensors that live in shared memory the rank's actor maps
step("zero-copy blocks (Pool.empty)")
blocks = pool.empty((64, 512 << 10), np.uint8)  # 64 blocks of 512 KiB, in /dev/shm
blocks[:] = np.random.default_rng(1).integers(0, 256, blocks.shape, dtype=np.uint8)
t0 = time.monotonic()
pool.put([f"blk{i}" for i in range(64)], list(blocks), rank=0)
dt = time.monotonic() - t0
print(f"   stored 32 MiB in one Ray call: {dt * 1e3:.0f} ms ({blocks.nbytes / dt / 1e9:.2f} GB/s)")
landing = pool.empty((64, 512 << 10), np.uint8)
pool.get([f"blk{i}" for i in range(64)], out=list(landing), rank=1)  # rank 1 reads rank 0's
print(f"   rank 1 read rank 0's blocks byte-exact: {np.array_equal(blocks, landing)}")

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
print(f"   prompt A: {len(hashes_a)} blocks stored by both ranks")
print(f"   prompt B: {pool.lookup(space, hashes_b)} of {len(hashes_b)} leading blocks in the pool")


# %% Async twins, for notebooks and actors
step("async API")


async def async_part() -> None:
    await pool.aput("async-key", np.arange(10, dtype=np.int64))
    value = await pool.aget("async-key", shape=(10,), dtype=np.int64)
    print(f"   aput/aget: {value.tolist()}")
    print(f"   alookup: {await pool.alookup(space, hashes_a)} blocks")


asyncio.run(async_part())

# %% Counters, the same ones `kvray status` prints
step("pool status")
print(pool.stats().table())

# %% Stop everything this demo started
step("shutting down")
pool.shutdown()
ray.shutdown()
print("   pool, embedded master and Ray stopped")
