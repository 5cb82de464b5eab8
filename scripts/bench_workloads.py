"""Workloads from the field against vLLM's OpenAI server, one server per arm: TTFT,
TPOT and end-to-end latency per request, and the speedup over full compute.

Workloads (``--workload``, one per run and JSON):

- ``chat``: a multi-user, multi-round chat whose working set is larger than the engine's
  KV cache (``--cache-blocks``). ``--users`` users share a system prompt; in each round
  every user sends their whole conversation so far plus a new message (``--turn-len``
  tokens), at most ``--concurrency`` requests in flight. The assistant's turns in the
  history are the workload's own tokens (``--reply-len``), not the model's output (a
  random-weight model's), so each round's prompt extends the user's previous prompt.
  Targets: kvray with vLLM's prefix cache on at or below half vLLM's prefix cache's p50
  TTFT, and at or below the peer's p50 and p90.
- ``ucm``: the UCM seed's table scaled to this machine: per input length
  (``--ucm-inputs``) and hit rate (``--ucm-hits``), ``--concurrency`` prompts, each with a
  prefix of its own; a warm-up request per prompt (its prefix and one token) stores the
  prefixes, then the prompts (the prefix and new tokens up to the length) are sent at
  once.
- ``prefix_repetition``: vLLM's own ``prefix_repetition`` dataset through its benchmark
  client (``vllm.benchmarks.serve``, called in this process: the CPU wheel's ``vllm`` CLI
  does not start), ``--max-concurrency`` ``--concurrency``.

Arms (``--arms``; each its own server, all up for the whole run; servers not in turn are
paused with SIGSTOP):

- ``none``: no connector, no prefix caching: full compute, the speedups' baseline;
- ``local``: vLLM's prefix cache alone;
- ``ideal`` (chat): vLLM's prefix cache with a KV cache that holds the chat's whole
  working set (every user's conversation, plus the requests in flight): nothing is
  evicted and nothing loaded, the best any cache below the engine can do on the same
  prompts and cores. (In ``ucm`` and ``prefix_repetition`` the engine's cache already holds
  every prompt of a case: there it is ``local``.)
- ``kvray``: KVRayConnector, prefix caching off (as the seeds run it);
- ``kvray-pc``: KVRayConnector with vLLM's prefix cache on (the pool below the engine's
  own cache);
- ``kvray-async``, ``kvray-pc-async``: the same with ``load_async: true`` (each request's
  hit loaded in a step of its own, reported as it lands, the request computed in the next
  step; by default only a step's second and later hits do);
- ``kvray-sync``, ``kvray-pc-sync``: the same with ``load_async: false`` (every hit of a
  step loaded before its forward);
- ``peer``: vLLM's MooncakeStoreConnector, prefix caching off (as bench_serve.py runs it);
- ``peer-pc``: the same with vLLM's prefix cache on.

Every engine's KV cache holds ``--cache-blocks`` blocks. The kvray arms share one pool
(keys of their own, ``model_namespace``); each peer arm has a ``mooncake_master`` of its
own. Reps are interleaved: each rep runs every arm in turn (order rotated per rep) on
fresh prompts (the same for every arm in the rep). Every request is recorded, and each
run's CPU (user + system time of every process below this one).

    W=chat  # or ucm, prefix_repetition
    .venv/bin/python scripts/bench_workloads.py --workload $W \
        --json bench-results/bench_workloads_$W.json
    .venv/bin/python scripts/bench_workloads.py --workload $W --smoke --json /tmp/$W.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import log, parse, write_json  # noqa: E402
from _cpu import CpuMeter  # noqa: E402
from _engines import (  # noqa: E402
    SMOKE_POOL_MEMORY,
    engine_env,
    pool_memory_arg,
    run_meta,
    start_bench_pool,
    start_peer_master,
)
from _forked_server import prestart, wait_all_healthy  # noqa: E402
from _serving import bench_client, serve_arm  # noqa: E402
from _stats import paired_ratio  # noqa: E402

from kvray.testing.server import Server  # noqa: E402

WORKLOADS = ("chat", "ucm", "prefix_repetition")
ARMS = ("none", "local", "ideal", "kvray", "kvray-pc", "kvray-async", "kvray-pc-async",
        "kvray-sync", "kvray-pc-sync", "peer", "peer-pc")  # fmt: skip
LOAD_ASYNC = {"-async": True, "-sync": False}
"""An arm's suffix -> the ``load_async`` it runs kvray with (the default without one)."""


def base_arm(arm: str) -> str:
    """The arm without its ``load_async`` suffix."""
    for suffix in LOAD_ASYNC:
        arm = arm.removesuffix(suffix)
    return arm


DEFAULT_ARMS = {"chat": "none,local,ideal,kvray,kvray-pc,peer"}
"""``--arms``'s default per workload (else :data:`OTHER_ARMS`)."""
OTHER_ARMS = "none,local,kvray,kvray-pc,peer"
BLOCK = 128
"""vLLM's block size on its CPU backend (tokens)."""
CACHE_BLOCKS = {"chat": 80, "ucm": 288, "prefix_repetition": 288}
"""The engines' KV cache per workload (``--cache-blocks``'s default): under a third of
the chat's working set; room for every concurrent prompt of the others."""
VOCAB = 1000
"""Prompt tokens are drawn from ``[3, VOCAB)`` (the tiny model's vocabulary is 1024)."""

SMOKE = ["--arms", "local,kvray-pc", "--reps", "1", "--users", "3", "--rounds", "2",
         "--system-len", "64", "--turn-len", "96", "--reply-len", "32",
         "--ucm-inputs", "256", "--ucm-hits", "0.5", "--concurrency", "2",
         "--pr-prefix-len", "64", "--pr-suffix-len", "32", "--pr-num-prefixes", "2",
         "--pr-num-prompts", "4", "--output-len", "4",
         "--pool-memory", SMOKE_POOL_MEMORY]  # fmt: skip
"""``--smoke``: vLLM's prefix cache and kvray below it, one rep, a few short prompts."""
SMOKE_CACHE_BLOCKS = {"chat": 7, "ucm": 16, "prefix_repetition": 16}


# ---- the client --------------------------------------------------------------------------


async def complete(
    session: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, float]:
    """One streamed completion of the token ids ``prompt``: TTFT, TPOT, end to end (ms)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    end = time.perf_counter()
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"{url}: {tokens} of {max_tokens} tokens streamed")
    ttft = (first - start) * 1e3
    return {
        "ttft_ms": ttft,
        "tpot_ms": ((end - first) * 1e3 / (tokens - 1)) if tokens > 1 else 0.0,
        "e2e_ms": (end - start) * 1e3,
        "prompt_tokens": len(prompt),
    }


async def _send_all(
    server: Server, model: str, batches: list[list[list[int]]], max_tokens: int, limit: int
) -> list[list[dict[str, float]]]:
    """Each batch's prompts with at most ``limit`` in flight, batch after batch (a batch
    is a chat round: a user's next message follows their previous answer)."""
    import aiohttp

    url = server.url("/v1/completions")
    gate = asyncio.Semaphore(limit)
    timeout = aiohttp.ClientTimeout(total=600)
    out = []
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: list[int]) -> dict[str, float]:
            async with gate:
                return await complete(session, url, model, prompt, max_tokens)

        for batch in batches:
            out.append(list(await asyncio.gather(*(one(p) for p in batch))))
    return out


def send(
    server: Server, model: str, batches: list[list[list[int]]], max_tokens: int, limit: int
) -> list[list[dict[str, float]]]:
    return asyncio.run(_send_all(server, model, batches, max_tokens, limit))


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, VOCAB, n)]


# ---- the workloads -----------------------------------------------------------------------


def chat_rounds(args: argparse.Namespace, rep: int) -> list[list[list[int]]]:
    """Round r's prompts, one per user: the system prompt, the user's r earlier turns
    (message and reply), and the new message."""
    rng = np.random.default_rng([7, rep])
    system = tokens(rng, args.system_len)
    history = [list(system) for _ in range(args.users)]
    rounds = []
    for _ in range(args.rounds):
        batch = []
        for u in range(args.users):
            history[u] += tokens(rng, args.turn_len)
            batch.append(list(history[u]))
            history[u] += tokens(rng, args.reply_len)
        rounds.append(batch)
    return rounds


def ucm_cases(args: argparse.Namespace) -> list[tuple[str, int, float]]:
    return [
        (f"ucm {length} {hit:.0%}", length, hit)
        for length in args.ucm_inputs
        for hit in args.ucm_hits
    ]


def ucm_prompts(
    args: argparse.Namespace, length: int, hit: float, rep: int
) -> tuple[list[list[int]], list[list[int]]]:
    """``--concurrency`` (warm-up, prompt) pairs: the warm-up is the prompt's prefix (hit
    rate of the length, whole blocks) and one token of its own."""
    rng = np.random.default_rng([11, length, int(hit * 100), rep])
    prefix_len = int(hit * length) // BLOCK * BLOCK
    warm, probe = [], []
    for _ in range(args.concurrency):
        prefix = tokens(rng, prefix_len)
        warm.append(prefix + tokens(rng, 1))
        probe.append(prefix + tokens(rng, length - prefix_len))
    return warm, probe


def run_case(
    case: str,
    server: Server,
    model: str,
    args: argparse.Namespace,
    rep: int,
    client: Callable[[list[str]], object] | None,
    tmp: Path,
) -> list[dict[str, float]]:
    """One arm's turn at one case: its measured requests."""
    if case == "chat":
        rounds = send(server, model, chat_rounds(args, rep), args.output_len, args.concurrency)
        return [dict(r, round=i + 1) for i, batch in enumerate(rounds) for r in batch]
    if case == "prefix_repetition":
        assert client is not None
        return prefix_repetition(client, server, model, args, rep, tmp)
    length, hit = next((n, h) for c, n, h in ucm_cases(args) if c == case)
    warm, probe = ucm_prompts(args, length, hit, rep)
    send(server, model, [warm], 1, args.concurrency)
    time.sleep(1.0)  # the warm-ups' saves (a pause of every arm's, not a drain)
    return send(server, model, [probe], args.output_len, args.concurrency)[0]


def prefix_repetition(
    client: Callable[[list[str]], object],
    server: Server,
    model: str,
    args: argparse.Namespace,
    rep: int,
    tmp: Path,
) -> list[dict[str, float]]:
    """vLLM's ``prefix_repetition`` dataset through ``vllm bench serve``."""
    out = tmp / f"{server.name}-pr-{rep}.json"
    argv = [
        "--backend", "vllm", "--base-url", server.url(), "--model", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.pr_prefix_len),
        "--prefix-repetition-suffix-len", str(args.pr_suffix_len),
        "--prefix-repetition-num-prefixes", str(args.pr_num_prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.pr_num_prompts), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--seed", str(2000 + rep), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,e2el", "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    try:
        client(argv)
    except Exception as exc:
        raise RuntimeError(f"bench serve against {server.name} failed: {exc!r}") from exc
    res = json.loads(out.read_text())
    if res.get("completed") != args.pr_num_prompts:
        raise RuntimeError(f"{server.name}: {res.get('completed')} of {args.pr_num_prompts} done")
    reqs = []
    for ttft, itls, lat, n in zip(
        res["ttfts"], res["itls"], res["latencies"], res["input_lens"], strict=True,
    ):  # fmt: skip
        reqs.append({
            "ttft_ms": ttft * 1e3,
            "tpot_ms": statistics.mean(itls) * 1e3 if itls else 0.0,
            "e2e_ms": lat * 1e3,
            "prompt_tokens": n,
        })  # fmt: skip
    return reqs


# ---- the servers -------------------------------------------------------------------------


def start_arms(
    arms: list[str], model: str, max_len: int, env: dict[str, str], tmp: Path,
    args: argparse.Namespace, stops: list[Callable[[], Any]],
) -> tuple[dict[str, Server], Any]:  # fmt: skip
    """Every arm's server (and the pool and masters they use); the kvray pool or None."""
    import ray

    from kvray.config import MooncakeMasterConfig

    master = MooncakeMasterConfig().model_dump()
    pool = None
    if any(arm.startswith("kvray") for arm in arms):
        pool, env["RAY_ADDRESS"] = start_bench_pool(args.pool_memory, "512MB", master=master)
        stops += [ray.shutdown, pool.shutdown]
    servers: dict[str, Server] = {}
    for arm in arms:
        blocks = args.ideal_blocks if arm == "ideal" else args.cache_blocks
        extra = ("--num-gpu-blocks-override", str(blocks))
        log(f"== starting the {arm} server")
        aenv = dict(env)
        kvray = None
        if arm.startswith("peer"):
            (tmp / arm).mkdir()
            peer_master, peer_env = start_peer_master(
                tmp / arm, master, segment=args.pool_memory, local_buffer=512 << 20
            )
            stops.append(peer_master.stop)
            aenv.update(peer_env)
        elif arm.startswith("kvray"):
            kvray = {"pool_name": "bench", "model_namespace": f"workloads-{arm}", **args.connector}
            for suffix, load_async in LOAD_ASYNC.items():
                if arm.endswith(suffix):
                    kvray["load_async"] = load_async
        caching = base_arm(arm) in ("local", "ideal", "kvray-pc", "peer-pc")
        servers[arm] = s = serve_arm(
            arm, model, max_len, aenv, tmp, prefix_caching=caching,
            kvray=kvray, peer=arm.startswith("peer"), extra=extra,
        )  # fmt: skip
        if not args.smoke:  # one at a time: engines start slowly
            s.wait_healthy(time.monotonic() + 600)
            s.pause()
    if args.smoke:
        wait_all_healthy(list(servers.values()))
    return servers, pool


def rotated(arms: list[str], rep: int) -> list[str]:
    k = rep % len(arms)
    return arms[k:] + arms[:k]


def cases_of(args: argparse.Namespace) -> list[str]:
    if args.workload == "ucm":
        return [c for c, _, _ in ucm_cases(args)]
    return [args.workload]


def schedule(args: argparse.Namespace, arms: list[str]) -> Iterator[tuple[int, str, str]]:
    for rep in range(args.reps):
        for case in cases_of(args):
            for arm in rotated(arms, rep):
                yield rep, case, arm


# ---- the report --------------------------------------------------------------------------


def pctl(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run_summary(reqs: list[dict[str, float]]) -> dict[str, float]:
    ttft = [r["ttft_ms"] for r in reqs]
    return {
        "p50_ttft_ms": pctl(ttft, 50),
        "p90_ttft_ms": pctl(ttft, 90),
        "mean_ttft_ms": statistics.mean(ttft),
        "mean_tpot_ms": statistics.mean(r["tpot_ms"] for r in reqs),
        "mean_e2e_ms": statistics.mean(r["e2e_ms"] for r in reqs),
    }


def per_rep(runs: list[dict[str, Any]], case: str, arm: str, key: str) -> list[float]:
    """``key`` of ``arm``'s runs of ``case``, in rep order (paired across arms)."""
    sel = sorted((r for r in runs if r["case"] == case and r["arm"] == arm),
                 key=lambda r: r["rep"])  # fmt: skip
    return [r[key] for r in sel]


def opt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def summarize(
    runs: list[dict[str, Any]], arms: list[str], cases: list[str]
) -> list[dict[str, Any]]:
    """Per case and arm: medians over reps of each run's p50 / p90 TTFT, mean TPOT and
    end to end; paired per rep, the speedup of mean TTFT over ``none`` and the p50 TTFT
    over ``local`` and ``peer``."""

    table = []
    print()
    print(f"{'case':18} {'arm':9} {'p50 TTFT':>9} {'p90 TTFT':>9} {'TPOT':>7} {'E2E':>8} "
          f"{'x none':>7} {'p50/local':>10} {'p50/peer':>9} {'pool hits':>10}")  # fmt: skip
    for case in cases:
        for arm in arms:
            row: dict[str, Any] = {"case": case, "arm": arm}
            for key in ("p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "mean_e2e_ms"):
                row[key] = statistics.median(per_rep(runs, case, arm, key))
            for base, key, name in (("none", "mean_ttft_ms", "speedup_over_none"),
                                    ("local", "p50_ttft_ms", "p50_over_local"),
                                    ("peer", "p50_ttft_ms", "p50_over_peer")):  # fmt: skip
                row[name] = None
                if base in arms and arm != base:
                    num, den = per_rep(runs, case, base, key), per_rep(runs, case, arm, key)
                    if name == "speedup_over_none":
                        row[name] = paired_ratio(num, den)["median"]
                    else:
                        row[name] = paired_ratio(den, num)["median"]
            row["pool_hit_blocks"] = sum(per_rep(runs, case, arm, "pool_hit_blocks"))
            row["total_blocks"] = sum(per_rep(runs, case, arm, "total_blocks"))
            table.append(row)

            hits = f"{row['pool_hit_blocks']}/{row['total_blocks']}" if row["total_blocks"] else "-"
            print(f"{case:18} {arm:9} {row['p50_ttft_ms']:9.1f} {row['p90_ttft_ms']:9.1f} "
                  f"{row['mean_tpot_ms']:7.1f} {row['mean_e2e_ms']:8.1f} "
                  f"{opt(row['speedup_over_none'], '.2f'):>7} "
                  f"{opt(row['p50_over_local'], '.2f'):>10} "
                  f"{opt(row['p50_over_peer'], '.2f'):>9} {hits:>10}")  # fmt: skip
    print("\nms, medians over reps of each run's p50 / p90 TTFT, mean TPOT and end to end; "
          "x none: mean TTFT speedup over full compute, p50/local and p50/peer: p50 TTFT "
          "ratios; all paired per rep (medians)")  # fmt: skip
    return table


CHAT_TARGETS = (
    ("kvray-pc", "local", "p50_ttft_ms", 0.5),
    ("kvray-pc", "peer", "p50_ttft_ms", 1.0),
    ("kvray-pc", "peer", "p90_ttft_ms", 1.0),
    ("kvray-pc", "ideal", "p50_ttft_ms", None),
    ("ideal", "local", "p50_ttft_ms", None),
    ("kvray-pc-async", "kvray-pc", "p50_ttft_ms", None),
    ("kvray-pc-async", "kvray-pc", "p90_ttft_ms", None),
    ("kvray-pc-sync", "kvray-pc", "p50_ttft_ms", None),
    ("kvray-pc-sync", "kvray-pc", "p90_ttft_ms", None),
)
"""The chat's targets (arm, baseline arm, metric, bound on the paired ratio): kvray with
vLLM's prefix cache on against the prefix cache alone and the peer; without a bound, what
stands beside them: kvray against the ideal, the ideal against the prefix cache alone
(the least any cache below the engine can reach on these prompts and cores), and kvray
with async and sync loads against the default (``auto``)."""


def chat_targets(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """The chat's targets and the ratios beside them, paired per rep (None where an arm
    was not run); keyed ``<metric>_over_<base>`` for kvray-pc's, else
    ``<arm>_<metric>_over_<base>``."""

    out: dict[str, Any] = {}
    for arm, base, key, bound in CHAT_TARGETS:
        if arm != base_arm(arm) and arm not in arms:
            continue  # (the optional arms' comparisons: only where they ran)
        metric = key.split("_")[0]
        name = f"{arm} {metric} TTFT / {base}"
        entry: dict[str, Any] = {"arm": arm, "median": None, "ci95": None, "ratios": None,
                                 "bound": bound, "met": None}  # fmt: skip
        if {arm, base} <= set(arms):
            ratio = paired_ratio(per_rep(runs, "chat", arm, key), per_rep(runs, "chat", base, key))
            lo, hi = ratio["ci95"]
            entry.update(median=ratio["median"], ci95=ratio["ci95"], ratios=ratio["ratios"])
            ci = f"{ratio['median']:.2f} [{lo:.2f}, {hi:.2f}]"
            if bound is None:
                print(f"{name}: {ci}")
            else:
                entry["met"] = met = ratio["median"] <= bound
                print(f"target {name} <= {bound}: {ci} {'met' if met else 'NOT met'}")
        prefix = "" if arm == "kvray-pc" else f"{arm}_"
        out[f"{prefix}{metric}_over_{base}"] = entry
    return out


# ---- main --------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="chat")
    parser.add_argument("--arms", help="comma-separated, from: " + ", ".join(ARMS) + " (default: "
                        f"{DEFAULT_ARMS['chat']} for chat, else {OTHER_ARMS})")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-serve-model")
    )
    parser.add_argument("--cache-blocks", type=int, help="each engine's KV cache, in blocks "
                        f"(default per workload: {CACHE_BLOCKS})")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--output-len", type=int, default=16)
    chat = parser.add_argument_group("chat")
    chat.add_argument("--users", type=int, default=16)
    chat.add_argument("--rounds", type=int, default=6)
    chat.add_argument("--system-len", type=int, default=512)
    chat.add_argument("--turn-len", type=int, default=128)
    chat.add_argument("--reply-len", type=int, default=128)
    ucm = parser.add_argument_group("ucm")
    ucm.add_argument("--ucm-inputs", type=lambda s: [int(x) for x in s.split(",")],
                     default=[2048, 4096, 8192])  # fmt: skip
    ucm.add_argument("--ucm-hits", type=lambda s: [float(x) for x in s.split(",")],
                     default=[0.5, 0.9])  # fmt: skip
    pr = parser.add_argument_group("prefix_repetition")
    pr.add_argument("--pr-prefix-len", type=int, default=1024)
    pr.add_argument("--pr-suffix-len", type=int, default=256)
    pr.add_argument("--pr-num-prefixes", type=int, default=4)
    pr.add_argument("--pr-num-prompts", type=int, default=16)
    parser.add_argument(
        "--connector", type=json.loads, default={},
        help="more kv_connector_extra_config for the kvray arms (JSON)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write results here")
    pool_memory_arg(parser)
    args = parse(parser, SMOKE)
    if args.arms is None:
        args.arms = DEFAULT_ARMS.get(args.workload, OTHER_ARMS)
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if "ideal" in arms and args.workload != "chat":
        parser.error(f"--arms: 'ideal' is the chat's (in {args.workload} the engine's cache "
                     "already holds every prompt of a case: use 'local')")  # fmt: skip
    if args.reps < 1 or args.concurrency < 1:
        parser.error("--reps and --concurrency must be >= 1")
    if args.cache_blocks is None:
        args.cache_blocks = (SMOKE_CACHE_BLOCKS if args.smoke else CACHE_BLOCKS)[args.workload]
    longest = {
        "chat": args.system_len + args.rounds * (args.turn_len + args.reply_len),
        "ucm": max(args.ucm_inputs),
        "prefix_repetition": args.pr_prefix_len + args.pr_suffix_len,
    }[args.workload]
    in_flight = -(-(longest + args.output_len) // BLOCK) * args.concurrency
    if args.cache_blocks < in_flight:
        parser.error(f"--cache-blocks {args.cache_blocks}: {args.concurrency} requests of up to "
                     f"{longest} tokens need {in_flight}")  # fmt: skip
    if args.workload == "chat":
        working_set = args.users * -(-longest // BLOCK)
        args.ideal_blocks = working_set + in_flight
        log(f"== chat working set {working_set} blocks, engine cache {args.cache_blocks}"
            + (f", the ideal's {args.ideal_blocks}" if "ideal" in arms else ""))  # fmt: skip
        if working_set <= args.cache_blocks:
            parser.error(f"--cache-blocks {args.cache_blocks}: the chat's working set "
                         f"({working_set} blocks) must be larger")  # fmt: skip

    from kvray.testing.tiny_model import build_tiny_llama

    log(f"== building a small GQA Llama in {args.model_dir}")
    max_len = longest + args.output_len + 64
    model = str(
        build_tiny_llama(
            args.model_dir, hidden_size=512, intermediate_size=1408, num_layers=4,
            num_heads=8, num_kv_heads=2, max_positions=max(max_len, 4256),
        )
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="kvray-bench-workloads-"))
    env = engine_env(tmp, None)
    prestart(env, tmp)
    stops: list[Callable[[], Any]] = []
    servers: dict[str, Server] = {}
    runs: list[dict[str, Any]] = []
    try:
        servers, _pool = start_arms(arms, model, max_len, env, tmp, args, stops)
        client = bench_client() if args.workload == "prefix_repetition" else None
        meter = CpuMeter()
        for rep, case, arm in schedule(args, arms):
            s = servers[arm]
            s.resume()
            before = len(s.request_counts())
            cpu0 = meter.total_s()
            t0 = time.monotonic()
            reqs = run_case(case, s, model, args, rep, client, tmp)
            wall = time.monotonic() - t0
            cpu = meter.total_s() - cpu0
            time.sleep(0.5)  # the server's last request lines
            lines = s.request_counts()[before:]
            s.pause()
            run = {"case": case, "arm": arm, "rep": rep, "wall_s": wall, "cpu_s": cpu,
                   **run_summary(reqs),
                   "pool_hit_blocks": sum(ln["hit_pool"] for ln in lines),
                   "total_blocks": sum(ln["total_blocks"] for ln in lines),
                   "requests": reqs}  # fmt: skip
            runs.append(run)
            log(f"   rep {rep} {case:16} {arm:9} p50 TTFT {run['p50_ttft_ms']:8.1f} ms "
                f"p90 {run['p90_ttft_ms']:8.1f}  TPOT {run['mean_tpot_ms']:6.1f}  "
                f"E2E {run['mean_e2e_ms']:8.1f}  ({wall:.1f} s)", stamp=True)  # fmt: skip
    finally:
        with ThreadPoolExecutor() as stopping:
            list(stopping.map(lambda s: s.stop(), servers.values()))
        for stop in reversed(stops):
            stop()
    shutil.rmtree(tmp)  # server logs: kept when the run failed

    table = summarize(runs, arms, cases_of(args))
    targets = chat_targets(runs, arms) if args.workload == "chat" else {}
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("json", "smoke", "model_dir", "pool_memory")
    }
    settings["connector"] = json.dumps(args.connector)  # (its keys are the user's, not ours)
    meta = run_meta(**settings, block=BLOCK,
                    order="interleaved: per rep and case every arm in turn, rotated; "
                          "others paused (SIGSTOP)")  # fmt: skip
    write_json(args.json, {"meta": meta, "table": table, "targets": targets, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
