"""A kvray workload as a Ray job: attach to (or start) a pool, store and load KV-like
blocks for a few "requests" sharing a prefix, verify every byte, print the pool status.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python scripts/pool_job.py --name kvray --start

Inside a job, ``ray.init()`` joins the job's cluster (outside one: the cluster of
``RAY_ADDRESS``, else a new local one). ``--start`` starts the pool when none runs
(detached: it outlives the job; ``kvray down`` stops it); ``--down`` stops it at the end.
``--smoke``: 2 requests of 4 blocks of 16 KiB; ``--json``: the run's counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse, write_json  # noqa: E402

SMOKE = ["--requests", "2", "--blocks", "4", "--block-kib", "16"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="kvray", help="pool name")
    parser.add_argument("--namespace", default="kvray", help="Ray namespace of the pool")
    parser.add_argument("--start", action="store_true", help="start the pool if none runs")
    parser.add_argument("--down", action="store_true", help="stop the pool at the end")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=32, help="blocks per request")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the run's counts here")
    args = parse(parser, SMOKE)

    import ray

    from kvray import KeySpace, KVLayout, Pool, PoolConfig, chain_block_hashes
    from kvray.errors import PoolNotFoundError

    ray.init(namespace=args.namespace, log_to_driver=False)
    try:
        pool = Pool.attach(args.name, args.namespace)
        print(f"attached to pool {args.name!r} at {pool.server_address}")
    except PoolNotFoundError:
        if not args.start:
            raise
        pool = Pool.start(PoolConfig.from_dict({"name": args.name, "namespace": args.namespace}))
        print(f"started pool {args.name!r} at {pool.server_address}")

    block = args.block_kib << 10
    space = KeySpace("pool-job", KVLayout("uint8", 16, 1, block // 32).tag())
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, 16 * args.blocks // 2).tolist()  # half of each prompt
    t0 = time.monotonic()
    hit_blocks = total_blocks = 0
    for req in range(args.requests):
        tokens = shared + rng.integers(0, 1000, 16 * args.blocks // 2).tolist()
        hashes = chain_block_hashes(tokens, 16)
        hit = pool.lookup(space, hashes)
        hit_blocks += hit
        total_blocks += len(hashes)
        if hit:  # "load" the hit prefix and check it is what was stored
            got = pool.get([space.key(h) for h in hashes[:hit]], shape=(block,))
            for h, g in zip(hashes[:hit], got, strict=True):
                assert g is not None and np.array_equal(g, _block_bytes(h, block)), "bad bytes"
        new = hashes[hit:]  # "compute" the rest and store it
        pool.put([space.key(h) for h in new], [_block_bytes(h, block) for h in new])
        print(
            f"request {req}: {len(hashes)} blocks, {hit} from the pool, {len(new)} stored",
            flush=True,
        )
    dt = time.monotonic() - t0
    print(
        f"\n{args.requests} requests in {dt:.2f} s, pool hit rate {hit_blocks / total_blocks:.0%}"
    )
    print(pool.stats().table())
    write_json(
        args.json,
        {
            "requests": args.requests,
            "seconds": dt,
            "hit_blocks": hit_blocks,
            "total_blocks": total_blocks,
            "hit_rate": hit_blocks / total_blocks,
        },
    )
    if args.down:
        pool.shutdown()
        print(f"pool {args.name!r} stopped")
    else:
        pool.close()
    return 0


def _block_bytes(block_hash: bytes, size: int) -> np.ndarray:
    """Deterministic content per block, so any reader can verify what it loaded."""
    seed = int.from_bytes(block_hash[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


if __name__ == "__main__":
    sys.exit(main())
