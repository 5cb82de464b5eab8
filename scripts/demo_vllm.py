"""The main job: a real vLLM engine with KVRayConnector on a local kvray pool.

Starts a local Ray cluster on 127.0.0.1, a kvray pool with its embedded
``mooncake_master``, builds a small Llama locally (no downloads) and starts vLLM on it
with the connector (vLLM's own prefix cache off, so every reuse goes through the pool).
Then it runs a prefix-heavy workload twice, like running ``vllm bench serve`` twice:
pass 1 computes and stores the prefixes, pass 2 loads them. It prints TTFT and pool hit
rates per pass and stops everything it started.

    make demo      # or: .venv/bin/python scripts/demo_vllm.py [--requests 8] [--json out.json]
    .venv/bin/python scripts/demo_vllm.py --smoke   # 2 requests of 272 tokens per pass
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 only
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault(
    "VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "kvray-demo-vllm-cache")
)
# vLLM gives its engine process 5 s to exit after SIGTERM, and the engine 5 s for its
# workers, then SIGKILLs them ("force killing remaining process"), which can leave its
# shared-memory queues to the resource tracker. Measured on a 2-core machine, vLLM alone
# (no connector): the worker takes ~4 s to exit (the interpreter's final garbage
# collection of torch's and vLLM's objects) and the engine core is force-killed. On a
# loaded machine that exit is several times slower (9 s beside three busy processes; over
# 30 s in CI beside a second test worker), so the engine gets 120 s: an idle machine still
# exits in ~4 s, and only a hung worker waits the whole time.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "120")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse, write_json  # noqa: E402
from _engines import run_meta  # noqa: E402

SMOKE = ["--requests", "2", "--groups", "1", "--prefix-tokens", "256", "--suffix-tokens", "16",
         "--kv-cache-blocks", "33"]  # fmt: skip
"""``--smoke``: both passes, one prefix of 2 blocks asked twice each, on an engine whose
KV cache holds 33 blocks (66 MiB: one request of the engine's 4096 tokens and vLLM's null
block, what vLLM requires) instead of 1 GiB: the whole cache is placed in shared memory,
beside another test worker's. What is left of its time is fixed: Ray and the pool, vLLM
imported three times (this process, then the engine core and its worker, which vLLM's
CPU backend always spawns), and shutdown."""


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per pass")
    parser.add_argument("--prefix-tokens", type=int, default=1536, help="shared prefix length")
    parser.add_argument("--groups", type=int, default=2, help="distinct shared prefixes")
    parser.add_argument("--suffix-tokens", type=int, default=200, help="unique tokens per request")
    parser.add_argument(
        "--kv-cache-blocks",
        type=int,
        help="the engine's KV cache in blocks (default: VLLM_CPU_KVCACHE_SPACE, 1 GiB)",
    )
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-demo-model")
    )
    parser.add_argument("--json", type=Path, help="write the passes' results here")
    args = parse(parser, SMOKE)

    import numpy as np
    import ray

    from kvray import Pool, PoolConfig
    from kvray.ray_env import ray_init
    from kvray.testing.tiny_model import build_prefill_bound_llama

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
        num_gpu_blocks_override=args.kv_cache_blocks,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVRayConnector",
            "kv_connector_module_path": "kvray.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool_name": "kvray"},
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
    passes: list[dict[str, Any]] = []
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
        deadline = time.monotonic() + 10  # (the engine reports its lookups just after them)
        while after.lookups - before.lookups < len(workload) and time.monotonic() < deadline:
            time.sleep(0.1)
            after = pool.stats().total
        blocks = after.lookup_blocks - before.lookup_blocks
        hits = after.lookup_hit_blocks - before.lookup_hit_blocks
        passes.append(
            {
                "pass": n,
                "ttft_p50_s": statistics.median(ttfts),
                "ttft_mean_s": statistics.mean(ttfts),
                "ttfts_s": ttfts,
                "pool_hit_rate": hits / blocks if blocks else 0.0,
                "blocks_loaded": after.get_keys - before.get_keys,
                "blocks_stored": after.put_keys - before.put_keys,
            }
        )

    step("results")
    print(
        f"{'pass':<6}{'TTFT p50 ms':>12}{'TTFT mean ms':>14}{'pool hit rate':>15}"
        f"{'blocks loaded':>15}{'blocks stored':>15}"
    )
    for p in passes:
        print(
            f"{p['pass']:<6}{p['ttft_p50_s'] * 1e3:>12.1f}{p['ttft_mean_s'] * 1e3:>14.1f}"
            f"{p['pool_hit_rate']:>14.0%}{p['blocks_loaded']:>15}{p['blocks_stored']:>15}"
        )
    ratio = passes[1]["ttft_p50_s"] / passes[0]["ttft_p50_s"]
    print(f"\nTTFT p50 pass 2 / pass 1: {ratio:.2f}")
    print(pool.stats().table())

    step("shutting down")
    t0 = time.monotonic()
    del llm
    pool.shutdown()
    ray.shutdown()
    print(f"   engine, pool, embedded master and Ray stopped in {time.monotonic() - t0:.1f} s")
    settings = ("requests", "prefix_tokens", "groups", "suffix_tokens")
    write_json(
        args.json, {"meta": run_meta(**{k: getattr(args, k) for k in settings}), "passes": passes}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
