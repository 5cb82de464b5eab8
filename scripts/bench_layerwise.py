"""Layer-wise transfers (``use_layerwise``) against whole-step transfers, on pool hits.

Each configuration is a live vLLM engine (its own process, kept up for the whole run);
the repetitions are interleaved: for every (input length, hit rate, rep) each engine in
turn, in an order rotated per rep, seeds the prefix (its own key namespace) and then
times one request that starts with it (TTFT: one generated token, alone in its engine).
Engines not taking their turn are paused (SIGSTOP), so their background threads do not
take CPU from the one being measured.

- ``local``: vLLM's prefix cache, prefix resident in the engine (the ideal: no transfer);
- ``kvray``: KVRayConnector, ``shared`` placement, whole-step loads (the baseline);
- ``kvray-lw``: the same with ``use_layerwise`` (one group per layer by default);
- ``staged`` / ``staged-lw``: the ``staged`` placement (the GPU/NPU code path, on CPU
  tensors) without and with ``use_layerwise``.

Every rep is recorded; the table shows medians and the layer-wise change of TTFT
(negative: faster). The engines' request lines are checked afterwards: a measured
request that did not load its prefix from the pool, or any failed load, is an error
(the comparison would be void).

    .venv/bin/python scripts/bench_layerwise.py --json bench-results/bench_layerwise.json
    .venv/bin/python scripts/bench_layerwise.py --smoke --json /tmp/bench_layerwise.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import log, parse, write_json  # noqa: E402
from _engines import (  # noqa: E402
    SMOKE_POOL_MEMORY,
    Engine,
    bench_model,
    chosen,
    engine_env,
    interleaved,
    kvray_transfer_config,
    live_engines,
    prestart_fork_servers,
    run_meta,
    start_bench_pool,
    start_engines,
    workload,
    workload_args,
)

BLOCK = 128
CONFIGS = ("local", "kvray", "kvray-lw", "staged", "staged-lw")
SMOKE = ["--lengths", "256", "--rates", "0.5", "--reps", "3", "--pool-memory", SMOKE_POOL_MEMORY]
"""``--smoke``: every configuration, one short input with a one-block hit, 3 reps; the
engines started together, without their warm-up request (``start_engines``)."""


def engine_spec(name: str, model: str, max_len: int, groups: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": model, "max_len": max_len, "prefix_caching": name == "local"}
    if name != "local":
        extra = {
            "pool_name": "bench",
            "load_async": False,
            "kv_placement": "staged" if name.startswith("staged") else "shared",
            "model_namespace": f"bench-{name}",  # each configuration seeds its own blocks
        }
        if name.endswith("-lw"):
            extra.update(use_layerwise=True, layerwise_groups=groups)
        spec["kv_transfer_config"] = kvray_transfer_config(extra)
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(parser, "1024,4096", "0.5,0.9")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--groups", type=int, default=4, help="layerwise_groups (model: 4 layers)")
    args = parse(parser, SMOKE)
    configs = args.configs.split(",")
    chosen(parser, configs, CONFIGS)
    lengths, rates = workload(parser, args)  # layer-wise only matters on hits

    tmp = Path(tempfile.mkdtemp(prefix="kvray-bench-layerwise-"))
    prestart_fork_servers([engine_env(tmp, None)], tmp)
    model = bench_model(args.model_dir)
    pool, ray_address = start_bench_pool(segment=args.pool_memory)
    env = engine_env(tmp, ray_address)
    reps: dict[tuple[str, int, float], list[float]] = {}
    measured = {name: 0 for name in configs}
    with live_engines(tmp, [pool.shutdown]) as engines:
        specs = {n: (engine_spec(n, model, max(lengths) + 16, args.groups), env) for n in configs}
        start_engines(engines, specs, tmp, args.smoke)
        total = len(lengths) * len(rates) * args.reps
        schedule = interleaved(configs, lengths, rates, args.reps, BLOCK)
        for done, (length, rate, rep, _, seed, probe, order) in enumerate(schedule, 1):
            for name in order:
                ttft = engines[name].turn(seed, probe, back_to_back=args.back_to_back)["ttft_s"]
                reps.setdefault((name, length, rate), []).append(ttft)
                measured[name] += 1
            last = "  ".join(f"{n} {reps[(n, length, rate)][-1] * 1e3:7.1f}" for n in configs)
            log(f"   [{done}/{total}] input {length} hit {rate:.0%} rep {rep}: {last} ms")
        checks = {name: check_loads(engines[name], measured[name]) for name in configs}

    rows = []
    for length in lengths:
        for rate in rates:
            row: dict[str, Any] = {"input_tokens": length, "hit_rate": rate}
            for name in configs:
                times = reps[(name, length, rate)]
                row[name] = {"median_s": statistics.median(times), "reps_s": times}
            rows.append(row)
    print_table(rows, configs)
    meta = run_meta(
        reps=args.reps,
        layerwise_groups=args.groups,
        order="interleaved: per rep every config in turn, order rotated per rep; "
        "engines not in turn paused (SIGSTOP)",
        load_checks=checks,
    )
    write_json(args.json, {"meta": meta, "rows": rows})
    return 0


def check_loads(engine: Engine, measured: int) -> dict[str, int]:
    """Every probe request of a connector engine loaded its prefix from the pool, and
    no load failed; the comparison is void otherwise."""
    lines = engine.request_counts()
    if engine.name == "local":
        return {"requests": measured}
    loaded = [ln for ln in lines if ln["loaded"] > 0]
    failed = sum(ln["failed"] for ln in lines)
    if failed or len(loaded) < measured:
        raise RuntimeError(
            f"{engine.name}: {len(loaded)} of {measured} timed requests loaded from the pool "
            f"and {failed} blocks failed to load (see {engine.log_path}): results void"
        )
    return {"requests": measured, "loaded_requests": len(loaded), "failed_blocks": failed}


def print_table(rows: list[dict[str, Any]], configs: list[str]) -> None:
    def ms(row: dict[str, Any], name: str) -> str:
        if name not in row:
            return f"{'-':>15}"
        reps = row[name]["reps_s"]
        spread = (max(reps) - min(reps)) / row[name]["median_s"]
        return f"{row[name]['median_s'] * 1e3:9.1f} ±{spread / 2:4.0%}"

    def change(row: dict[str, Any], lw: str, base: str) -> str:
        if lw not in row or base not in row:
            return f"{'-':>9}"
        a, b = row[lw]["median_s"], row[base]["median_s"]
        return f"{(a - b) / b:+9.1%}"

    print()
    print(
        f"{'input':>6} {'hit':>5} "
        + " ".join(f"{n + ' ms':>15}" for n in configs)
        + f" {'lw shared':>9} {'lw staged':>9}"
    )
    for r in rows:
        print(
            f"{r['input_tokens']:>6} {r['hit_rate']:>5.0%} "
            + " ".join(ms(r, n) for n in configs)
            + f" {change(r, 'kvray-lw', 'kvray')} {change(r, 'staged-lw', 'staged')}"
        )
    print(
        "\nmedian TTFT per configuration ± half the range of its reps, relative; lw = "
        "layer-wise TTFT change (medians) against the same placement's whole-step transfers "
        "(negative: faster)"
    )


if __name__ == "__main__":
    sys.exit(main())
