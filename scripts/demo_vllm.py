"""The main job: a real vLLM engine with KVRayConnector on a local kvray pool.

Starts a local Ray cluster on 127.0.0.1, a kvray pool with its embedded
``mooncake_master``, builds a small Llama locally (no downloads) and starts vLLM on it
with the connector (vLLM's own prefix cache off, so every reuse goes through the pool).
Then it runs a prefix-heavy workload twice, like running ``vllm bench serve`` twice:
pass 1 computes and stores the prefixes, pass 2 loads them. It prints TTFT and pool hit
rates per pass and stops everything it started.

    make demo      # or: .venv/bin/python scripts/demo_vllm.py [--requests 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 only
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault(
    "VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "kvray-demo-vllm-cache")
)


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per pass")
    parser.add_argument("--prefix-tokens", type=int, default=1536, help="shared prefix length")
    parser.add_argument("--groups", type=int, default=2, help="distinct shared prefixes")
    parser.add_argument("--suffix-tokens", type=int, default=200, help="unique tokens per request")
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-demo-model")
    )
    args = parser.parse_args()

    import numpy as np
    import ray

    from kvray import Pool, PoolConfig
    from kvray.ray_env import ray_init
    from kvray.tiny_model import build_prefill_bound_llama

    step("starting a local Ray cluster on 127.0.0.1 and a kvray pool (embedded mooncake_master)")
    t0 = time.monotonic()
    ray_init("local", num_cpus=4)
    # vLLM's engine process joins this cluster the way deployed engines do.
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    pool = Pool.start(
        PoolConfig.from_dict(
            {
                "name": "kvray",
                "world_size": 1,
                "detached": False,
                "mooncake": {"global_segment_size": "1GB", "local_buffer_size": "64MB"},
            },
            environ={},
        )
    )
    print(f"   Ray + pool up in {time.monotonic() - t0:.1f} s; master at {pool.server_address}")

    step(f"building a small Llama in {args.model_dir} (cached after the first run)")
    t0 = time.monotonic()
    model = build_prefill_bound_llama(args.model_dir)
    print(f"   ready in {time.monotonic() - t0:.1f} s")

    step("starting vLLM (CPU) with KVRayConnector, prefix caching off")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=str(model),
        enforce_eager=True,
        dtype="float32",
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVRayConnector",
            "kv_connector_module_path": "kvray.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool_name": "kvray", "load_async": False},
        },
    )
    print(f"   engine up in {time.monotonic() - t0:.1f} s")

    rng = np.random.default_rng(0)
    prefixes = [rng.integers(3, 1000, args.prefix_tokens).tolist() for _ in range(args.groups)]
    workload = [
        prefixes[i % args.groups] + rng.integers(3, 1000, args.suffix_tokens).tolist()
        for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    passes = []
    for n in (1, 2):
        step(
            f"pass {n}: {args.requests} requests, {args.groups} shared prefixes of "
            f"{args.prefix_tokens} tokens + {args.suffix_tokens} unique tokens each"
        )
        before = pool.stats().total
        ttfts = []
        for i, prompt in enumerate(workload):
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            ttfts.append(time.perf_counter() - t0)
            print(f"   request {i}: TTFT {ttfts[-1] * 1e3:7.1f} ms", flush=True)
        time.sleep(0.5)  # let the last saves land before reading the counters
        after = pool.stats().total
        blocks = after.lookup_blocks - before.lookup_blocks
        hits = after.lookup_hit_blocks - before.lookup_hit_blocks
        passes.append(
            (
                statistics.median(ttfts),
                statistics.mean(ttfts),
                hits / blocks if blocks else 0.0,
                after.get_keys - before.get_keys,
                after.put_keys - before.put_keys,
            )
        )

    step("results")
    print(
        f"{'pass':<6}{'TTFT p50 ms':>12}{'TTFT mean ms':>14}{'pool hit rate':>15}"
        f"{'blocks loaded':>15}{'blocks stored':>15}"
    )
    for n, (p50, mean, rate, got, put) in enumerate(passes, 1):
        print(f"{n:<6}{p50 * 1e3:>12.1f}{mean * 1e3:>14.1f}{rate:>14.0%}{got:>15}{put:>15}")
    print(f"\nTTFT p50 pass 2 / pass 1: {passes[1][0] / passes[0][0]:.2f}")
    print(pool.stats().table())

    step("shutting down")
    del llm
    pool.shutdown()
    ray.shutdown()
    print("   engine, pool, embedded master and Ray stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
