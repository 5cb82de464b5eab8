"""Where a pool hit's time to first token goes: kvray's per-request timeline next to
vLLM's local prefix cache (the ideal: the prefix is resident, nothing to move) for the
same prompts. At a 0 % hit rate, a miss's: the seed is an unrelated prompt (stored), and
``--back-to-back`` sends the probe while the seed's saves are still in flight, as users
send requests.

Each configuration is a live engine (``scripts/_engines.py``); reps are interleaved and
engines not in turn are paused. For every (input length, hit rate, rep) each engine
seeds the prefix, then one request that starts with it is timed (``LLM.generate`` of one
token, alone in the engine); kvray's engine also returns that request's timeline
(:mod:`kvray.connector.timeline`). The table splits kvray's TTFT into:

- ``to lookup``: from vLLM's arrival stamp to the lookup being sent;
- ``lookup``: sent to answered, as the scheduler saw it (``waits``: steps it sat out);
- ``async load``: a hybrid model's (asynchronous) load, from the answer to its end
  reaching the scheduler (the steps the request sat in WAITING_FOR_REMOTE_KVS), less
  the BackendClient's own time serving it (counted in ``load client``): the send, the
  node channel, the worker noticing the end and the steps around it;
- ``to step``: from there to the step that computes its first token being handed to the
  workers (scheduling, block allocation, metadata);
- ``load client`` and ``load rest``: that step waiting for pool loads, split into the
  time the BackendClient spent serving them (its backend's get, the checksum
  verification; as it measured it, reported over the node channel; with an async load,
  its serving time too, though the step did not wait for it) and the rest (the
  channel, the worker's own work, staged: the scatter; all of it with
  ``transfer_channel: ray``, which reports no split); ``forward``: the forward itself;
- ``after step``: the step's connector work after the forward (saves sent) and the step
  output getting back to the scheduler;
- ``to caller``: from there to ``generate`` returning (output processing);

medians over reps, next to the local prefix cache's TTFT and kvray's excess over it.

    .venv/bin/python scripts/ttft_breakdown.py --json bench-results/ttft_breakdown.json
    .venv/bin/python scripts/ttft_breakdown.py --actor-lookups --lengths 1024 --reps 10
    .venv/bin/python scripts/ttft_breakdown.py --smoke --json /tmp/ttft_breakdown.json
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
    bench_model,
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
PARTS = (
    "to_lookup",
    "lookup",
    "async_load",
    "to_step",
    "load_client",
    "load_rest",
    "forward",
    "after_step",
    "to_caller",
)
SMOKE = ["--lengths", "256", "--rates", "0.5", "--reps", "3", "--pool-memory", SMOKE_POOL_MEMORY]
"""``--smoke``: both engines, one short input with a one-block hit, 3 reps; the
engines started together, without their warm-up request (``start_engines``)."""


def split(ttft_ms: float, tl: dict[str, Any]) -> dict[str, float]:
    """kvray's TTFT in the parts of the table (ms); they sum to ``ttft_ms``."""
    lag = tl["arrival_lag_ms"]
    sent = tl["lookup_sent_ms"] if tl["lookup_sent_ms"] is not None else tl["admitted_ms"]
    answered = tl["lookup_answered_ms"] if tl["lookup_answered_ms"] is not None else sent
    loaded = tl.get("async_loaded_ms") or answered
    built, done = tl["first_step_built_ms"], tl["first_token_ms"]
    load, forward = tl["load_wait_ms"] or 0.0, tl["forward_ms"] or 0.0
    served = tl.get("load_served_ms") or 0.0
    async_served = tl.get("async_served_ms") or 0.0
    return {
        "to_lookup": lag + sent,
        "lookup": answered - sent,
        "async_load": loaded - answered - async_served,
        "to_step": built - loaded,
        "load_client": served + async_served,
        "load_rest": load - served,
        "forward": forward,
        "after_step": done - built - load - forward,
        "to_caller": ttft_ms - lag - done,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(parser, "1024,4096", "0.9")
    parser.add_argument("--placement", choices=("shared", "staged"), default="shared")
    parser.add_argument(
        "--family",
        choices=("llama", "gemma3", "qwen3_next"),
        default="llama",
        help="the model's family (gemma3: sliding-window groups beside full attention; "
        "qwen3_next: Gated DeltaNet state groups, bfloat16, kvray's engine with vLLM's "
        "prefix cache on and emptied before each probe, as bench_ttft runs it; both loaded "
        "asynchronously, as kvray must for such models)",
    )
    parser.add_argument(
        "--lookup-index",
        action="store_true",
        help="the pool answers lookups from the node's block index (lookup_index: true, "
        "the default)",
    )
    parser.add_argument(
        "--actor-lookups",
        action="store_true",
        help="lookups as calls to the node's Lookup actor (lookup_index: false)",
    )
    args = parse(parser, SMOKE)
    lengths, rates = workload(parser, args, misses=True)
    if args.lookup_index and args.actor_lookups:
        parser.error("--lookup-index and --actor-lookups exclude each other")

    tmp = Path(tempfile.mkdtemp(prefix="kvray-ttft-breakdown-"))
    prestart_fork_servers([engine_env(tmp, None)], tmp)
    model = bench_model(args.model_dir, args.family)
    hybrid = args.family != "llama"
    settings: dict[str, Any] = {"lookup_index": False} if args.actor_lookups else {}
    pool, ray_address = start_bench_pool(segment=args.pool_memory, **settings)
    env = engine_env(tmp, ray_address)
    base: dict[str, Any] = {"model": model, "max_len": max(lengths) + 16}
    states = args.family == "qwen3_next"  # (vLLM keeps states per block with its cache on)
    if states:
        base["dtype"] = "bfloat16"
    specs = {
        "local": {**base, "prefix_caching": True},
        "kvray": {
            **base,
            "prefix_caching": states,
            "timelines": True,
            "kv_transfer_config": kvray_transfer_config(
                {
                    "pool_name": "bench",
                    **({"load_async": True} if hybrid else {}),
                    "kv_placement": args.placement,
                    "model_namespace": "bench-breakdown",
                }
            ),
        },
    }
    samples: dict[tuple[int, float], dict[str, list[Any]]] = {}
    with live_engines(tmp, [pool.shutdown]) as engines:
        start_engines(engines, {n: (spec, env) for n, spec in specs.items()}, tmp, args.smoke)
        total = len(lengths) * len(rates) * args.reps
        # (a sliding-window model's own prefix cache keeps only the window before the seed's
        # end: the ideal's hit needs the seed to end at the prefix, as in bench_ttft)
        tail = 1 if hybrid else None
        block = BLOCK
        if states:  # (vLLM grows it so an attention page holds a state)
            block = int(engines["kvray"].call(op="block_size")["block_size"])
            engines["kvray"].pause()
        schedule = interleaved(["local", "kvray"], lengths, rates, args.reps, block, seed_tail=tail)
        for done, (length, rate, rep, _, seed, probe, order) in enumerate(schedule, 1):
            got = samples.setdefault((length, rate), {"local": [], "kvray": []})
            for name in order:
                reset_own = states and name == "kvray"
                ans = engines[name].turn(
                    seed, probe, back_to_back=args.back_to_back, reset_own=reset_own
                )
                ttft_ms = ans["ttft_s"] * 1e3
                if name == "local":
                    got["local"].append(ttft_ms)
                    continue
                (tl,) = ans["timelines"]
                if tl["first_token_ms"] is None or (rate > 0) != (tl["loaded"] > 0):
                    want = "load a hit" if rate > 0 else "miss"
                    raise RuntimeError(f"the timed request did not {want}: {tl}")
                got["kvray"].append({"ttft_ms": ttft_ms, "timeline": tl})
            log(
                f"   [{done}/{total}] input {length} hit {rate:.0%} rep {rep}: "
                f"local {got['local'][-1]:.1f} ms, kvray {got['kvray'][-1]['ttft_ms']:.1f} ms"
            )

    rows = []
    for (length, rate), got in samples.items():
        parts = [split(s["ttft_ms"], s["timeline"]) for s in got["kvray"]]
        row = {
            "input_tokens": length,
            "hit_rate": rate,
            "local_ttft_ms": statistics.median(got["local"]),
            "kvray_ttft_ms": statistics.median(s["ttft_ms"] for s in got["kvray"]),
            "parts_ms": {p: statistics.median(x[p] for x in parts) for p in PARTS},
            "lookup_wait_steps": statistics.median(
                s["timeline"]["lookup_wait_steps"] for s in got["kvray"]
            ),
            "reps": {"local_ttft_ms": got["local"], "kvray": got["kvray"]},
        }
        rows.append(row)
    print()
    print(
        f"{'input':>6} {'hit':>4} {'local':>7} {'kvray':>7} {'excess':>7} | "
        + " ".join(f"{p.replace('_', ' '):>10}" for p in PARTS)
        + f" {'waits':>5}"
    )
    for r in rows:
        print(
            f"{r['input_tokens']:>6} {r['hit_rate']:>4.0%} {r['local_ttft_ms']:7.1f} "
            f"{r['kvray_ttft_ms']:7.1f} {r['kvray_ttft_ms'] - r['local_ttft_ms']:+7.1f} | "
            + " ".join(f"{r['parts_ms'][p]:10.2f}" for p in PARTS)
            + f" {r['lookup_wait_steps']:5.0f}"
        )
    print(
        "\nms, medians over reps (each part's median: parts need not sum to the TTFT "
        "median); excess = kvray - local; waits = scheduler steps the request sat out "
        "for its lookup"
    )
    meta = run_meta(
        reps=args.reps,
        placement=args.placement,
        lookup_index=not args.actor_lookups,
        **({"family": args.family} if hybrid else {}),
        **(
            {
                "probe": "back to back: sent as soon as its seed returned (a miss's seed: "
                "an unrelated prompt, stored)"
            }
            if args.back_to_back
            else {}
        ),
        order="interleaved, alternating per rep; engine not in turn paused (SIGSTOP)",
    )
    write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
