"""Routing over a kvray pool: TTFT of a shared-prefix workload through kvray's proxy
(``python -m kvray.proxy``) in front of N vLLM OpenAI servers.

Arms (each a proxy of its own, all up for the whole run):

- ``local-rr``: N servers with only vLLM's own prefix cache, round-robin;
- ``local-router``: the same servers, the ``prefix`` policy on their KV events alone
  (with ``--arms ...,local-router``);
- ``pool-rr``: N servers with vLLM's prefix cache and KVRayConnector on one kvray pool,
  round-robin;
- ``pool-router``: the same servers, the ``prefix`` policy: the engines' KV events and
  the pool's.

The workload: ``--prefixes`` shared prefixes of ``--prefix-len`` tokens, each asked
``--requests-per-prefix`` times with a suffix of its own, in a shuffled order, one
request at a time (max_tokens 1: the latency is the TTFT). Each instance runs on a core of
its own (``VLLM_CPU_OMP_THREADS_BIND``), as instances have accelerators of their own.
Each engine's cache holds ``--cache-blocks`` blocks, fewer than the prefixes need
together, so one engine cannot hold them all; a router that keeps each prefix on one
instance lets both together hold them.

Reps are interleaved: every rep runs each arm in turn (order rotated per rep), on prompts
of its own (the pool arms share servers and pool: each arm's prefixes are fresh to both);
the servers of the arms not in turn are paused (SIGSTOP). Every request's TTFT is
recorded.

    .venv/bin/python scripts/bench_route.py --json bench-results/bench_route.json
    .venv/bin/python scripts/bench_route.py --smoke --json /tmp/bench_route.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import log, parse, write_json  # noqa: E402
from _engines import (  # noqa: E402
    SMOKE_POOL_MEMORY,
    engine_env,
    kvray_transfer_config,
    pool_memory_arg,
    run_meta,
    start_bench_pool,
)
from _forked_server import prestart, start_server, wait_all_healthy  # noqa: E402
from _stats import paired_ratio  # noqa: E402

from kvray.servers.process import free_port  # noqa: E402
from kvray.testing.server import Server, vllm_serve_cmd  # noqa: E402

ARMS = ("local-rr", "local-router", "pool-rr", "pool-router")
DEFAULT_ARMS = "local-rr,pool-rr,pool-router"
BLOCK = 128
"""vLLM's block size on the CPU backend."""
SMOKE = ["--prefixes", "4", "--prefix-len", "256", "--requests-per-prefix", "2",
         "--cache-blocks", "6", "--reps", "1", "--pool-memory", SMOKE_POOL_MEMORY]  # fmt: skip
"""``--smoke``: every default arm, 4 prefixes of 2 blocks asked twice, one rep; the
servers started together, without their warm-up request (and forked from the fork server
under the test suite: ``scripts/_forked_server.py``)."""


class Proxy:
    """``python -m kvray.proxy`` in mixed mode in front of ``ports``."""

    def __init__(
        self,
        arm: str,
        ports: list[int],
        args: argparse.Namespace,
        tmp: Path,
        bind: str | None,
        topics: list[str],
        pool_events: tuple[str, str] | None,
    ) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "kvray.proxy", "--port", str(self.port),
               "--instance-ports", *map(str, ports), "--health-interval", "0.5"]  # fmt: skip
        if arm.endswith("router"):
            cmd += ["--policy", "prefix", "--max-imbalance", str(args.max_imbalance)]
            if bind is not None:
                cmd += ["--kv-events-bind", bind, "--kv-topics", *topics]
            if pool_events is not None:
                cmd += ["--pool-kv-events", pool_events[0], "--pool-kv-replay", pool_events[1]]
        self.log = tmp / f"proxy-{arm}.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                body: dict[str, Any] = json.loads(r.read())
                return body
        except OSError as exc:  # a 503 (an instance unhealthy) still has the JSON body
            raw = getattr(exc, "read", lambda: b"")()
            return json.loads(raw) if raw else {"status": f"unreachable: {exc}"}

    def wait_healthy(self, timeout_s: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited {self.proc.returncode}: see {self.log}")
            h = self.health()
            if h.get("status") == "ok" and all(i["healthy"] for i in h.get("instance", [])):
                return h
            if time.monotonic() > end:
                raise RuntimeError(f"proxy {self.url} not healthy in {timeout_s:.0f} s: {h}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


def workload(args: argparse.Namespace, seed: list[int]) -> list[tuple[int, list[int]]]:
    """``(prefix index, prompt)`` in the order sent."""
    rng = random.Random(str(seed))
    prefixes = [[rng.randrange(3, 1000) for _ in range(args.prefix_len)]
                for _ in range(args.prefixes)]  # fmt: skip
    reqs = [(k, prefixes[k] + [rng.randrange(3, 1000) for _ in range(args.suffix_len)])
            for k in range(args.prefixes) for _ in range(args.requests_per_prefix)]  # fmt: skip
    rng.shuffle(reqs)
    return reqs


def ttft_s(url: str, model: str, prompt: list[int]) -> float:
    """One request of one output token, timed to its answer."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
    req = urllib.request.Request(f"{url}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}")
    return time.perf_counter() - t


def pct_ms(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=DEFAULT_ARMS)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--requests-per-prefix", type=int, default=4)
    parser.add_argument("--cache-blocks", type=int, default=48, help="each engine's KV cache")
    parser.add_argument("--max-imbalance", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-bench-model")
    )
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the servers' and proxies' logs"
    )
    pool_memory_arg(parser)
    args = parse(parser, SMOKE)
    arms = args.arms.split(",")
    if set(arms) - set(ARMS) or not arms:
        parser.error(f"--arms: choose from {', '.join(ARMS)}")
    if args.instances < 2:
        parser.error("--instances: routing needs 2 or more")
    if args.prefix_len % BLOCK or args.prefix_len < BLOCK:
        parser.error(f"--prefix-len: whole blocks of {BLOCK} tokens")
    if args.suffix_len >= BLOCK:
        parser.error(f"--suffix-len: under a block ({BLOCK}), so prefixes alone are shared")
    need = args.prefixes * args.prefix_len // BLOCK
    if need <= args.cache_blocks:
        parser.error(f"--cache-blocks {args.cache_blocks}: the prefixes need {need} blocks; "
                     "give fewer, so that one engine cannot hold them all")  # fmt: skip

    import ray

    from kvray.testing.tiny_model import build_prefill_bound_llama

    log(f"== building the model in {args.model_dir}")
    model = str(build_prefill_bound_llama(args.model_dir))
    tmp = Path(tempfile.mkdtemp(prefix="kvray-bench-route-"))
    env = engine_env(tmp, None)
    prestart(env, tmp)  # a smoke run's fork server imports vLLM while the pool starts
    groups = {"local": [a for a in arms if a.startswith("local")],
              "pool": [a for a in arms if a.startswith("pool")]}  # fmt: skip
    servers: dict[str, list[Server]] = {}
    proxies: dict[str, Proxy] = {}
    pool = None
    runs: list[dict[str, Any]] = []
    max_len = args.prefix_len + args.suffix_len + 64
    try:
        pool_events = None
        if groups["pool"]:
            ev_port, replay_port = free_port(), free_port()
            pool, env["RAY_ADDRESS"] = start_bench_pool(
                args.pool_memory,
                kv_events={"host": "loopback", "port": ev_port, "replay_port": replay_port},
            )
            pool_events = (f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}")
        for group, members in groups.items():
            if not members:
                continue
            ports = [free_port() for _ in range(args.instances)]
            topics = [f"kv@{group}{i}@bench" for i in range(args.instances)]
            router = next((a for a in members if a.endswith("router")), None)
            bind = f"tcp://127.0.0.1:{free_port()}" if router else None
            for arm in members:  # first: the engines' publishers connect to the router
                proxies[arm] = Proxy(arm, ports, args, tmp, bind if arm == router else None,
                                     topics, pool_events if group == "pool" else None)  # fmt: skip
            servers[group] = []
            for i, port in enumerate(ports):
                extra = ["--num-gpu-blocks-override", str(args.cache_blocks)]
                if bind is not None:
                    events = {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": bind, "topic": topics[i]}  # fmt: skip
                    extra += ["--kv-events-config", json.dumps(events)]
                if group == "pool":
                    connector = {"pool_name": "bench", "model_namespace": "bench-route"}
                    extra += ["--kv-transfer-config",
                              json.dumps(kvray_transfer_config(connector))]  # fmt: skip
                log(f"== starting {group} server {i} on port {port}")
                cmd = vllm_serve_cmd(model, port, *extra, max_model_len=max_len,
                                     prefix_caching=True)  # fmt: skip
                # A core of its own, as instances have their own accelerators: two CPU
                # workers binding the same cores spin against each other (vLLM's worker
                # busy-polls after each step), measured 0.5-1 s requests on 2 cores.
                core = {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
                s = start_server(
                    f"{group}{i}", cmd, {**env, **core}, tmp / f"{group}{i}.log", port=port
                )
                servers[group].append(s)
                if not args.smoke:  # one at a time, each warmed up before the next starts
                    s.wait_healthy(time.monotonic() + 600)
                    ttft_s(s.url(), model, list(range(3, 3 + BLOCK + 5)))  # warm-up
                    s.pause()
        if args.smoke:  # all started at once, not warmed up: it times nothing that counts
            wait_all_healthy([s for group_servers in servers.values() for s in group_servers])
        for rep in range(args.reps):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                group = arm.split("-")[0]
                for s in servers[group]:
                    s.resume()
                proxy = proxies[arm]
                proxy.wait_healthy()
                before = proxy.health()
                reqs = workload(args, [rep, ARMS.index(arm)])
                times = [ttft_s(proxy.url, model, prompt) for _, prompt in reqs]
                after = proxy.health()
                for s in servers[group]:
                    s.pause()
                r = {
                    "arm": arm, "rep": rep,
                    "p50_ms": pct_ms(times, 0.5), "p99_ms": pct_ms(times, 0.99),
                    "mean_ms": statistics.fmean(times) * 1e3,
                    "ttfts_ms": [t * 1e3 for t in times],
                    "prefixes": [k for k, _ in reqs],
                    "served": [b["served"] - a["served"]
                               for a, b in zip(before["instance"], after["instance"],
                                               strict=True)],
                    "router": after.get("instance_router"),
                }  # fmt: skip
                runs.append(r)
                log(f"   rep {rep} {arm:12} p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms"
                    f"  per instance {r['served']}")  # fmt: skip
    finally:
        with ThreadPoolExecutor() as stopping:  # each waits for its engine to exit
            list(stopping.map(lambda s: s.stop(), [s for g in servers.values() for s in g]))
        for p in proxies.values():
            p.stop()
        if pool is not None:
            pool.shutdown()
            ray.shutdown()
    if args.keep_logs:
        log(f"== logs kept in {tmp}")
    else:
        shutil.rmtree(tmp)  # logs: kept when the run failed

    table = summarize(runs, arms)
    print(f"\n{'arm':14} {'p50 ms':>8} {'p99 ms':>8} {'p50 / local-rr':>22} {'p50 / pool-rr':>22}")

    def ratio(v: dict[str, Any] | None) -> str:
        return f"{v['median']:.2f} [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]" if v else "-"

    for row in table:
        local, pool_rr = ratio(row["p50_vs_local_rr"]), ratio(row["p50_vs_pool_rr"])
        p50, p99 = row["p50_ms"], row["p99_ms"]
        print(f"{row['arm']:14} {p50:8.1f} {p99:8.1f} {local:>22} {pool_rr:>22}")
    meta = run_meta(
        reps=args.reps, instances=args.instances, prefixes=args.prefixes,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        requests_per_prefix=args.requests_per_prefix, cache_blocks=args.cache_blocks,
        max_imbalance=args.max_imbalance,
        order="interleaved: per rep every arm in turn, rotated; other servers paused",
    )  # fmt: skip
    write_json(args.json, {"meta": meta, "table": table, "runs": runs})
    return 0


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    """Per arm: the median over reps of each rep's p50 and p99, and its p50 over the
    baselines' in the same rep (median of per-rep ratios, 95 % interval)."""
    by = {a: [r for r in runs if r["arm"] == a] for a in arms}
    table = []
    for arm in arms:
        row: dict[str, Any] = {
            "arm": arm,
            "p50_ms": statistics.median(r["p50_ms"] for r in by[arm]),
            "p99_ms": statistics.median(r["p99_ms"] for r in by[arm]),
        }
        for base in ("local-rr", "pool-rr"):
            key = "p50_vs_" + base.replace("-", "_")
            row[key] = (
                paired_ratio([r["p50_ms"] for r in by[arm]], [r["p50_ms"] for r in by[base]])
                if base in by and base != arm
                else None
            )
        table.append(row)
    return table


if __name__ == "__main__":
    sys.exit(main())
