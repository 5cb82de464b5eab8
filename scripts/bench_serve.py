"""The seeds' evaluation, automated: vLLM's OpenAI server per mode, ``vllm bench serve``
twice on the same prompts (run 1 fills the caches, run 2 is all prefix hits), mean /
P90 / P99 TTFT of both runs.

Modes (each its own server, all up for the whole run; servers not in turn are paused with
SIGSTOP so their background threads do not take the measured server's CPU):

- ``none``: no connector, no prefix caching (everything computed, both runs);
- ``local``: vLLM's prefix cache (the ideal on run 2: nothing to move);
- ``peer``: vLLM's MooncakeStoreConnector (in-process Mooncake client, embedded mode,
  its own mooncake_master with the kvray master's settings), prefix caching off;
- ``kvray``: KVRayConnector on a kvray pool, prefix caching off (its default
  ``load_async: auto``);
- ``staged``: the same through the ``staged`` placement (with ``--modes ...,staged``);
- ``async``: ``kvray`` with ``load_async: true`` (with ``--modes ...,async``): each
  request's blocks load in a step of their own, reported per request as they land, and it
  computes in the next step;
- ``sync``: ``kvray`` with ``load_async: false`` (with ``--modes ...,sync``): every hit of a
  step loads before its forward;
- ``nock``: ``kvray`` on a second pool without block checksums (with ``--modes ...,nock``):
  with ``kvray`` beside it, the run prints what checksums cost run 2's mean TTFT (median of
  the per-rep ratios, 95 % bootstrap interval).

Reps are interleaved: every rep runs each mode in turn (order rotated per rep) on fresh
prompts (the rep's seed), so run 1 is cold again. Each run's CPU is counted too (user +
system time of every process below this one), and printed over ``none``'s per GB kvray's
pool moved in the same run. The benchmark client is vLLM's own
(``vllm.benchmarks.serve``, called in this process, imported once: the CPU wheel's
``vllm`` CLI fails on its version lookup) with the seeds' flags: random dataset,
``--num-prompts`` (12) of ``--input-len`` (4000) tokens, output 2, request rate inf. The
pool's hits per run come from the kvray server's request lines.

    .venv/bin/python scripts/bench_serve.py --json bench-results/bench_serve.json
    .venv/bin/python scripts/bench_serve.py --smoke --json /tmp/bench_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import log, parse  # noqa: E402
from _cpu import PartsMeter, cpu_per_gb, largest, split_medians  # noqa: E402
from _engines import (  # noqa: E402
    SMOKE_POOL_MEMORY,
    bench_pool,
    engine_env,
    pool_memory_arg,
    run_meta,
    start_bench_pool,
    start_peer_master,
)
from _forked_server import prestart, wait_all_healthy  # noqa: E402
from _serving import bench_client, serve_arm  # noqa: E402
from _stats import paired_ratio, pct  # noqa: E402

from kvray.testing.server import Server  # noqa: E402

MODES = ("none", "local", "peer", "kvray")
KVRAY_MODES = ("kvray", "staged", "nock", "async", "sync")
"""The modes that run KVRayConnector."""
SMOKE = ["--modes", "peer,kvray", "--input-len", "256", "--num-prompts", "2", "--reps", "1",
         "--kv-cache-gb", "1", "--pool-memory", SMOKE_POOL_MEMORY]  # fmt: skip
"""``--smoke``: the strongest baseline (``peer``) and ``kvray``, one rep of 2 prompts of
256 tokens (two blocks each). ``none`` and ``local`` are the same server with vLLM's own
flags (no connector; prefix caching off or on). The servers start together (and forked
from the fork server under the test suite: ``scripts/_forked_server.py``)."""


def serve(
    mode: str,
    model: str,
    max_len: int,
    env: dict[str, str],
    tmp: Path,
    more: dict[str, Any] | None = None,
) -> Server:
    """One OpenAI server for ``mode``; ``more``: more of the kvray modes' connector
    config."""
    kvray = None
    if mode in KVRAY_MODES:
        kvray = {
            "pool_name": "bench-nock" if mode == "nock" else "bench",
            "kv_placement": "staged" if mode == "staged" else "shared",
            "model_namespace": f"bench-serve-{mode}",
            **({"load_async": mode == "async"} if mode in ("async", "sync") else {}),
            **(more or {}),
        }
    return serve_arm(
        mode, model, max_len, env, tmp,
        prefix_caching=mode == "local", kvray=kvray, peer=mode == "peer",
    )  # fmt: skip


def bench_once(
    client: Callable[[list[str]], object],
    server: Server,
    model: str,
    args: argparse.Namespace,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    """One ``vllm bench serve`` run."""
    argv = [
        "--backend", "vllm",
        "--base-url", server.url(), "--model", model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", "2", "--num-prompts", str(args.num_prompts),
        "--request-rate", "inf", "--seed", str(seed), "--ignore-eos",
        "--percentile-metrics", "ttft", "--metric-percentiles", "90,99",
        "--save-result", "--save-detailed",  # (every request's TTFT: ``ttfts``)
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    try:
        client(argv)
    except Exception as exc:
        raise RuntimeError(f"bench serve against {server.name} failed: {exc!r}") from exc
    result: dict[str, Any] = json.loads(out.read_text())
    if result.get("completed") != args.num_prompts:
        raise RuntimeError(
            f"{server.name}: {result.get('completed')} of {args.num_prompts} requests completed"
        )
    return {
        "mean_ttft_ms": result["mean_ttft_ms"],
        "p90_ttft_ms": result["p90_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"],
        "ttfts_ms": [t * 1e3 for t in result.get("ttfts", [])],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-serve-model")
    )
    parser.add_argument("--kv-cache-gb", type=int, default=2, help="each server's KV cache")
    parser.add_argument(
        "--connector",
        type=json.loads,
        default={},
        help="more kv_connector_extra_config for the kvray modes (JSON), e.g. "
        "'{\"lookup_timeout_ms\": 5000}' on a machine busy with other work",
    )
    parser.add_argument("--json", type=Path, help="write results here (and a PNG next to it)")
    pool_memory_arg(parser)
    args = parse(parser, SMOKE)
    modes = args.modes.split(",")
    unknown = set(modes) - {*MODES, *KVRAY_MODES}
    if unknown:
        parser.error(
            f"unknown modes {sorted(unknown)}; choose from "
            f"{', '.join(sorted({*MODES, *KVRAY_MODES}))}"
        )
    if args.reps < 1:
        parser.error("--reps must be >= 1")

    import ray

    from kvray.config import MooncakeMasterConfig
    from kvray.testing.tiny_model import build_tiny_llama

    log(f"== building a small GQA Llama in {args.model_dir}")
    model = str(
        build_tiny_llama(
            args.model_dir, hidden_size=512, intermediate_size=1408, num_layers=4,
            num_heads=8, num_kv_heads=2, max_positions=args.input_len + 256,
        )
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="kvray-bench-serve-"))
    master_settings = MooncakeMasterConfig()
    env = engine_env(tmp, None, kv_cache_gb=args.kv_cache_gb)
    prestart(env, tmp)  # a smoke run's fork server imports vLLM while the pools start
    stops: list[Any] = []
    """Stopped last first."""
    servers: dict[str, Server] = {}
    runs: list[dict[str, Any]] = []
    pool: Any = None
    try:
        if set(KVRAY_MODES) & set(modes):
            pool, env["RAY_ADDRESS"] = start_bench_pool(
                args.pool_memory, "512MB", master=master_settings.model_dump()
            )
            stops += [ray.shutdown, pool.shutdown]
        if "nock" in modes:
            stops.append(
                bench_pool(
                    "bench-nock",
                    args.pool_memory,
                    "512MB",
                    master_settings.model_dump(),
                    checksum=False,
                ).shutdown
            )
        if "peer" in modes:
            peer_master, peer_env = start_peer_master(
                tmp, master_settings.model_dump(), segment=args.pool_memory, local_buffer=512 << 20
            )
            stops.append(peer_master.stop)
        for mode in modes:  # one at a time (but in a smoke run): engines start slowly
            log(f"== starting the {mode} server")
            menv = dict(env)
            if mode == "peer":
                menv.update(peer_env)
            servers[mode] = serve(mode, model, args.input_len + 64, menv, tmp, args.connector)
            if not args.smoke:
                servers[mode].wait_healthy(time.monotonic() + 600)
                servers[mode].pause()
        # A smoke run starts its servers at once (it times nothing that counts), and
        # imports the client while they start.
        client = bench_client()
        if args.smoke:
            wait_all_healthy(list(servers.values()))
        meter = PartsMeter()

        def pool_bytes() -> int:
            """What kvray's pool stored and loaded so far (0 without a kvray mode)."""
            if pool is None:
                return 0
            total = pool.stats().total
            return int(total.put_bytes + total.get_bytes)

        for rep in range(args.reps):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                s = servers[mode]
                s.resume()
                before = len(s.request_counts())
                for run in (1, 2):
                    out = tmp / f"{mode}-rep{rep}-run{run}.json"
                    cpu0, snap, bytes0 = meter.total_s(), meter.snapshot(), pool_bytes()
                    r = bench_once(client, s, model, args, seed=1000 + rep, out=out)
                    time.sleep(1.0)  # the server's last request lines (and saves)
                    r["cpu_s"] = meter.total_s() - cpu0
                    r["cpu_parts"] = by_size(meter.parts_since(snap)[0])
                    r["pool_bytes"] = pool_bytes() - bytes0
                    lines = s.request_counts()[before:]
                    before += len(lines)
                    r.update(
                        mode=mode,
                        rep=rep,
                        run=run,
                        pool_hit_blocks=sum(ln["hit_pool"] for ln in lines),
                        loaded_blocks=sum(ln["loaded"] for ln in lines),
                        total_blocks=sum(ln["total_blocks"] for ln in lines),
                    )
                    runs.append(r)
                    log(
                        f"   rep {rep} {mode:6} run {run}: mean TTFT {r['mean_ttft_ms']:8.1f} ms"
                        f" (P90 {r['p90_ttft_ms']:.1f}, P99 {r['p99_ttft_ms']:.1f})"
                        + (f", pool hits {r['pool_hit_blocks']}/{r['total_blocks']} blocks"
                           if lines else "")
                    )  # fmt: skip
                s.pause()
    finally:
        with ThreadPoolExecutor() as stopping:  # each waits for its engine to exit
            list(stopping.map(lambda s: s.stop(), servers.values()))
        for stop in reversed(stops):
            stop()
    shutil.rmtree(tmp)  # server logs: kept when the run failed

    table = summarize(runs, modes)
    checksum = checksum_cost(runs) if {"kvray", "nock"} <= set(modes) else None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = run_meta(
            reps=args.reps,
            input_len=args.input_len,
            num_prompts=args.num_prompts,
            order="interleaved: per rep every mode in turn, rotated; others paused (SIGSTOP)",
        )
        results: dict[str, Any] = {"meta": meta, "table": table, "runs": runs}
        if checksum is not None:
            results["checksum_cost"] = checksum
        args.json.write_text(json.dumps(results, indent=2))
        plot(table, args.json.with_suffix(".png"))
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


def checksum_cost(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Run 2's mean TTFT with block checksums (kvray) over without (nock), per rep."""

    def run2(mode: str) -> list[float]:
        sel = sorted(
            (r for r in runs if r["mode"] == mode and r["run"] == 2), key=lambda r: r["rep"]
        )
        return [r["mean_ttft_ms"] for r in sel]

    cost = paired_ratio(run2("kvray"), run2("nock"))
    lo, hi = cost["ci95"]
    print(
        f"checksum cost on run 2's mean TTFT: {pct(cost['median'])} (95 % CI {pct(lo)} .. "
        f"{pct(hi)}, {cost['pairs']} paired reps: kvray / nock)"
    )
    return cost


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    table = []
    print()
    print(
        f"{'mode':8} {'run 1 mean':>11} {'run 2 mean':>11} {'run 2 P90':>10} {'run 2 P99':>10}"
        f" {'spread':>7} {'pool hits run 2':>16}"
    )
    for mode in modes:
        row: dict[str, Any] = {"mode": mode}
        for run in (1, 2):
            sel = [r for r in runs if r["mode"] == mode and r["run"] == run]
            for k in ("mean_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"):
                row[f"run{run}_{k}"] = statistics.median(r[k] for r in sel)
            means = [r["mean_ttft_ms"] for r in sel]
            row[f"run{run}_spread"] = (max(means) - min(means)) / 2 / statistics.median(means)
            row[f"run{run}_hits"] = sum(r["pool_hit_blocks"] for r in sel)
            row[f"run{run}_blocks"] = sum(r["total_blocks"] for r in sel)
        table.append(row)
        hits = f"{row['run2_hits']}/{row['run2_blocks']}" if row["run2_blocks"] else "-"
        print(
            f"{mode:8} {row['run1_mean_ttft_ms']:11.1f} {row['run2_mean_ttft_ms']:11.1f}"
            f" {row['run2_p90_ttft_ms']:10.1f} {row['run2_p99_ttft_ms']:10.1f}"
            f" {row['run2_spread']:6.0%} {hits:>16}"
        )
    print("\nTTFT in ms, medians over reps; spread = half the range of run 2's means, relative")
    cpu_table(runs, modes, table)
    return table


def cpu_table(runs: list[dict[str, Any]], modes: list[str], table: list[dict[str, Any]]) -> None:
    """Each mode's CPU per run (every process below this one: the servers, Ray, the pools'
    actors, the masters), and over ``none``'s in the same rep, per GB kvray's pool stored
    and loaded in that rep's run (the peer's bytes are the same prompts' blocks). Adds
    ``run<n>_cpu_s``, ``run<n>_cpu_over_none_ms`` and ``run<n>_cpu_s_per_gb`` (None where
    there is no ``none`` or no kvray mode) to ``table``'s rows."""

    def of(mode: str, run: int, key: str) -> list[float]:
        sel = sorted(
            (r for r in runs if r["mode"] == mode and r["run"] == run), key=lambda r: r["rep"]
        )
        return [r[key] for r in sel]

    print(f"\n{'mode':8} {'run 1 CPU s':>12} {'run 2 CPU s':>12} {'over none, ms':>16} "
          f"{'s per GB moved':>16}")  # fmt: skip
    for row in table:
        mode = row["mode"]
        cells = []
        for run in (1, 2):
            cpu = of(mode, run, "cpu_s")
            row[f"run{run}_cpu_s"] = statistics.median(cpu)
            row[f"run{run}_cpu_over_none_ms"] = row[f"run{run}_cpu_s_per_gb"] = None
            if mode != "none" and "none" in modes and "kvray" in modes:
                over = cpu_per_gb(cpu, of("none", run, "cpu_s"), of("kvray", run, "pool_bytes"))
                row[f"run{run}_cpu_over_none_ms"] = over["extra_cpu_ms"]
                row[f"run{run}_cpu_s_per_gb"] = over["cpu_s_per_gb"]
            cells.append(row[f"run{run}_cpu_s"])
        over_ms = [row[f"run{run}_cpu_over_none_ms"] for run in (1, 2)]
        per_gb = [row[f"run{run}_cpu_s_per_gb"] for run in (1, 2)]
        print(f"{mode:8} {cells[0]:12.2f} {cells[1]:12.2f} {_pair(over_ms, '.0f'):>16} "
              f"{_pair(per_gb, '.2f'):>16}")  # fmt: skip
    print(
        "CPU: user + system seconds of every process below this one, medians over reps; "
        "over none: paired per rep, run 1 / run 2; per GB: of what kvray's pool stored "
        "and loaded in the same run"
    )
    cpu_parts_table(runs, table)


CPU_PARTS_SHOWN = 8
"""Process kinds printed per run in the CPU split (the largest; the JSON has them all)."""


def by_size(parts: dict[str, float]) -> list[list[Any]]:
    """``parts`` as ``[name, value]`` pairs, the largest first (a list, not an object: the
    process kinds of a run are not keys of the JSON's format)."""
    return [[n, v] for n, v in sorted(parts.items(), key=lambda kv: -kv[1])]


def cpu_parts_table(runs: list[dict[str, Any]], table: list[dict[str, Any]]) -> None:
    """Where each mode's CPU in each run went, by process kind (vLLM's engine core and
    worker, the API server, the pool's actors, the masters): the median over reps of each
    kind's milliseconds (``run<n>_cpu_parts_ms`` in ``table``'s rows, as pairs)."""
    for row in table:
        for run in (1, 2):
            sel = [
                dict(r["cpu_parts"]) for r in runs if r["mode"] == row["mode"] and r["run"] == run
            ]
            row[f"run{run}_cpu_parts_ms"] = by_size(split_medians(sel))
    modes = [row["mode"] for row in table]
    for run in (1, 2):
        medians = {row["mode"]: dict(row[f"run{run}_cpu_parts_ms"]) for row in table}
        kinds = largest(medians, CPU_PARTS_SHOWN)
        print(f"\nCPU ms of run {run} by process (median over reps)")
        print(f"{'process':>26} " + " ".join(f"{m:>9}" for m in modes))
        for n in kinds:
            print(f"{n[:26]:>26} " + " ".join(f"{medians[m].get(n, 0.0):9.1f}" for m in modes))


def _pair(values: list[float | None], fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(table))
    for i, run in enumerate((1, 2)):
        ax.bar(
            [j + (i - 0.5) * 0.38 for j in x],
            [r[f"run{run}_mean_ttft_ms"] for r in table],
            width=0.38,
            label=f"run {run}" + (" (prefix hits)" if run == 2 else " (cold)"),
        )
    ax.set_xticks(list(x), [r["mode"] for r in table])
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("vllm bench serve, twice")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
