"""Soak under faults: a real vLLM OpenAI server with KVRayConnector, many concurrent
requests with shared prefixes, for a bounded time, while faults hit the pool at random.

    .venv/bin/python scripts/soak.py --duration 900 --checksum on --json bench-results/soak.json

What runs: a tiny Llama built locally; first a server *without* a connector answers every
prompt once (the oracle; ``--oracle PATH`` keeps its tokens for another run of the same
model and prompts); then a loopback Ray, a kvray pool (``mooncake|ssd``: a small
DRAM tier over an SSD tier, block checksums ``--checksum on|off``, embedded
``mooncake_master``) and a server with KVRayConnector (vLLM's own prefix cache off, so
every repeat goes to the pool; ``kv_load_failure_policy: recompute``).
``--clients`` threads send streaming completions of random prompts (``--prefixes`` shared
prefixes x ``--suffixes`` endings) until ``--duration`` ends and every kind of fault has
been injected once (at most ``--max-duration``: a slow machine's faults take longer to
show, and a round of them must fit); every ``--fault-every``
seconds (jittered) one fault, in a shuffled round robin of ``--faults``
(scripts/_soak_faults.py): ``kill_client`` (the rank's BackendClient SIGKILLed; Ray
restarts it), ``kill_master`` (the embedded ``mooncake_master`` SIGKILLed; the pool
restarts it), ``remove_blocks`` (blocks of random prompts removed while requests load
them), ``corrupt_ssd`` (SSD block files with a byte flipped, or truncated), ``pool_full``
(the DRAM tier filled with other blocks, held ``--hold`` s, removed), ``shm_full``
(``/dev/shm`` filled to ``--shm-headroom`` bytes free, or ``--ram-reserve`` short of
available memory where /dev/shm is as large as RAM; held, freed).

Every fault must show that it took effect (a PID that changed, a restart Ray counted,
``exists()`` false for the removed blocks, files that read back changed, bytes the fill
wrote: scripts/_soak_faults.py), within ``--recover-s``; the kills also wait until the
DRAM tier takes a put again. A fault whose injection raised or whose effect is not shown
stops the load and fails the run, and so does a kind of ``--faults`` never injected.

Oracle (exit code 1 if any fails): every completed request's greedy tokens equal the
no-connector run's; no request takes longer than ``--max-request-s``; no request fails;
afterwards no process, ``/dev/shm`` file (kvray's or vLLM's ``psm_*``) or file descriptor
of this run is left. Reported (and in ``--json``): requests, blocks hit and loaded,
blocks recomputed after each fault kind (a request's failed loads count under the last
fault before it ended), misses by reason (vLLM's ``/metrics``), TTFT percentiles, each
fault with its evidence, the run's arguments and commit. Every request's detail goes to
``--requests-json`` only (a long run has hundreds of thousands).

A CI-sized run (tests/e2e/test_soak.py) is this same run with smaller arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import log as common_log  # noqa: E402
from _engines import kvray_transfer_config, run_meta  # noqa: E402
from _soak_faults import FAULTS, HOLDS, FaultNotShown, Faults  # noqa: E402
from _soak_load import block_keys, completion, make_prompts, serve, server_metrics  # noqa: E402
from _soak_oracle import oracle_tokens  # noqa: E402
from _soak_report import (  # noqa: E402
    Row,
    blocks_by_fault,
    open_descriptors,
    per_window,
    percentiles,
    print_report,
    shm_entries,
)

NAMESPACE = "soak"
MEASURES = (
    "kvray",
    "actors",
    "scripts/_engines.py",
    "scripts/_common.py",
    "scripts/soak.py",
    "scripts/_soak_faults.py",
    "scripts/_soak_load.py",
    "scripts/_soak_oracle.py",
    "scripts/_soak_report.py",
)
"""What the soak's result depends on (``scripts/report.py --stale``)."""


def log(msg: str) -> None:
    common_log(msg, stamp=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--duration",
        type=float,
        default=120.0,
        help="seconds of load (longer until every kind of --faults was injected once, up to "
        "--max-duration)",
    )
    parser.add_argument(
        "--max-duration",
        type=float,
        help="the longest the load goes on for a kind not yet injected (default: 3 x --duration)",
    )
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--suffixes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--fault-every", type=float, default=10.0)
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="comma-separated kinds; each must be injected (with its effect shown) at least "
        "once (the load goes on past --duration for one not yet injected)",
    )
    parser.add_argument("--hold", type=float, default=3.0, help="seconds a fill fault holds")
    parser.add_argument(
        "--recover-s",
        type=float,
        default=60.0,
        help="how long a fault may take to show its effect (a restart, the DRAM tier "
        "serving again, blocks or files to act on)",
    )
    parser.add_argument("--shm-headroom", type=int, default=64 << 20, help="bytes left")
    parser.add_argument(
        "--ram-reserve", type=int, default=3 << 30, help="shm_full leaves this much RAM"
    )
    parser.add_argument("--max-request-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm", action="store_true", help="store every prompt first")
    parser.add_argument("--vllm-args", default="", help="more arguments for the kvray server")
    parser.add_argument(
        "--no-connector",
        action="store_true",
        help="the same load on a server without kvray (with --faults '': the faults on "
        "blocks need a connector that stores them)",
    )
    parser.add_argument("--dram", default="32MB", help="the DRAM tier (small: it evicts)")
    parser.add_argument("--connector", default="{}", help="more kv_connector_extra_config (JSON)")
    parser.add_argument(
        "--checksum",
        choices=("on", "off"),
        default="on",
        help="the pool's block checksums (the pool's default: on); the oracle is the same",
    )
    parser.add_argument("--model", help="a model directory (default: build the tiny Llama)")
    parser.add_argument(
        "--oracle",
        type=Path,
        help="a file for the no-connector run's tokens: read when it holds them for the same "
        "model files, prompts and --max-tokens, else computed and written",
    )
    parser.add_argument("--json", type=Path, help="the summary (counts, faults, meta)")
    parser.add_argument("--requests-json", type=Path, help="every request's detail")
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; choose from {', '.join(FAULTS)}")
    return args


def inject(faults: Faults, kind: str, at_s: float, hold_s: float) -> Row:
    """One fault, held and undone where it holds: its record (``ok``: its effect shown)."""
    started = time.monotonic()
    record: Row = {
        "at_s": round(at_s, 3),
        "kind": kind,
        "ok": False,
        "what": "",
        "evidence": {},
        "error": None,
    }
    try:
        try:
            evidence = getattr(faults, kind)()
            record.update(ok=True, what=evidence.what, evidence=evidence.shown)
        except FaultNotShown as exc:
            record.update(error=str(exc), evidence=exc.shown)
        if record["ok"] and kind in HOLDS:
            time.sleep(hold_s)
    except Exception as exc:  # an injection that raised is a fault not shown
        record["error"] = f"raised {exc!r}"[:500]
    finally:
        if kind in HOLDS:
            try:
                getattr(faults, f"undo_{kind}")()
            except Exception as exc:
                record.update(ok=False, error=f"undo raised {exc!r}"[:500])
    record["took_s"] = round(time.monotonic() - started, 3)
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds: list[str] = args.kinds

    import psutil

    shm_before = shm_entries()
    tmp = Path(tempfile.mkdtemp(prefix="kvray-soak-"))
    cache = os.environ.get("VLLM_CACHE_ROOT") or str(tmp / "cache")  # the user's, or the run's
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": cache}
    env.pop("PYTHONHASHSEED", None)  # vLLM's default seed: block_keys() hashes the same
    if args.model:
        model = str(args.model)
    else:
        from kvray.testing.tiny_model import build_tiny_llama

        model = str(build_tiny_llama(tmp / "tiny-llama"))
    prompts = make_prompts(args.prefixes, args.suffixes, args.seed)
    log(f"== {len(prompts)} prompts ({args.prefixes} prefixes x {args.suffixes}); oracle")
    oracle, oracle_from = oracle_tokens(model, prompts, args.max_tokens, env, tmp, args.oracle)
    log(f"   oracle {oracle_from}")

    import ray

    from kvray import Pool, PoolConfig
    from kvray.ray_env import ray_init

    log(f"== loopback Ray, pool 'soak' (mooncake|ssd, checksum {args.checksum}), server")
    ray_init("local", num_cpus=2)
    # This process's descriptors are compared from here (Ray's driver keeps its own log
    # files and sockets after ray.shutdown(): Ray's, not this run's) to after the pool's
    # shutdown.
    fds_before, fd_targets_before = len(os.listdir("/proc/self/fd")), open_descriptors()
    ssd_dir = tmp / "ssd"
    ssd_dir.mkdir()
    pool = Pool.start(PoolConfig.from_dict({
        "name": "soak", "world_size": 1, "detached": False, "checksum": args.checksum == "on",
        "pipeline": "mooncake|ssd", "ssd": {"path": str(ssd_dir), "quota": "256MB"},
        "mooncake": {"global_segment_size": args.dram, "local_buffer_size": "16MB"},
        "master": {"default_kv_lease_ttl_ms": 500, "client_ttl_s": 2},
        "call_timeout_s": 20,
    }, environ={}))  # fmt: skip
    pool_checksum = bool(pool.config.checksum)
    # The connector's defaults (checksums, the node's index, the node channel, the lookup
    # timeout), as users run it; --connector adds settings.
    extra = {"pool_name": "soak", "model_namespace": NAMESPACE, **json.loads(args.connector)}
    kv_env = {**env, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    # vLLM's default policy fails a request whose load failed; a cache recomputes.
    transfer = json.dumps({**kvray_transfer_config(extra), "kv_load_failure_policy": "recompute"})
    connector = [] if args.no_connector else ["--kv-transfer-config", transfer]
    connector += args.vllm_args.split()
    server = serve("kvray", model, connector, kv_env, tmp)
    results: list[Row] = []
    fault_log: list[Row] = []
    corrupt_at: list[int] = []
    """The pool's DRAM checksum failures so far, as each fault ended."""
    faults: Faults | None = None
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()
    try:
        server.wait_healthy(time.monotonic() + 600)
        space = None if args.no_connector else server.key_space()
        faults = Faults(
            pool,
            ssd_dir,
            [block_keys(p, space) if space else [] for p in prompts],
            seed=args.seed,
            recover_s=args.recover_s,
            shm_headroom=args.shm_headroom,
            ram_reserve=args.ram_reserve,
        )
        if args.warm:  # every prompt once, one at a time: the pool holds them all
            for p in prompts:
                completion(server.port, model, p, args.max_tokens, args.max_request_s)
        t0 = time.monotonic()
        end_at = t0 + args.duration
        stop_at = t0 + max(args.duration, args.max_duration or 3 * args.duration)

        def client(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while not stop.is_set():
                k = rng.randrange(len(prompts))
                start = time.monotonic() - t0
                row: Row
                try:
                    tokens, ttft, total, rid = completion(
                        server.port, model, prompts[k], args.max_tokens, args.max_request_s
                    )
                    row = {"prompt": k, "start_s": start, "ttft_s": ttft, "total_s": total,
                           "id": rid, "ok": tokens == oracle[k]}  # fmt: skip
                    if not row["ok"]:
                        row["tokens"], row["expected"] = tokens, oracle[k]
                except Exception as exc:  # a failed or timed-out request is a finding
                    row = {"prompt": k, "start_s": start, "error": repr(exc)[:300],
                           "total_s": time.monotonic() - t0 - start}  # fmt: skip
                with lock:
                    results.append(row)

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(args.clients)]  # fmt: skip
        for t in threads:
            t.start()
        rng = random.Random(args.seed)
        order: list[str] = []
        next_fault = t0 + args.fault_every * rng.uniform(0.5, 1.5)
        last_report = t0
        while not stop.is_set():
            now = time.monotonic()
            shown_kinds = {f["kind"] for f in fault_log if f["ok"]}
            if now >= stop_at or (now >= end_at and shown_kinds >= set(kinds)):
                break
            if now >= next_fault and kinds:
                if not order:
                    order = rng.sample(kinds, len(kinds))
                record = inject(faults, order.pop(), now - t0, args.hold)
                fault_log.append(record)
                corrupt_at.append(pool.stats().total.get_corrupt)
                shown = record["what"] if record["ok"] else f"NOT SHOWN: {record['error']}"
                log(f"   fault at {now - t0:5.1f} s: {record['kind']}: {shown}")
                if not record["ok"]:
                    failures.append(f"{record['kind']} at {now - t0:.1f} s: {record['error']}")
                    stop.set()  # a fault not shown ends the run: the rest proves nothing
                next_fault = time.monotonic() + args.fault_every * rng.uniform(0.5, 1.5)
            if now - last_report >= 15:
                last_report = now
                with lock:
                    done = len(results)
                    bad = sum(1 for r in results if not r.get("ok"))
                log(f"   {now - t0:5.0f}/{args.duration:.0f} s: {done} requests, {bad} not ok")
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(timeout=args.max_request_s + 10)
            if t.is_alive():
                failures.append("a client thread still waits past --max-request-s")
        lines = {line.request_id: line.counts for line in server.request_lines()}
        metrics = server_metrics(server)
        pool_stats = pool.stats()
    finally:
        stop.set()
        if faults is not None:
            faults.undo_shm_full()
            with contextlib.suppress(Exception):  # a failed fill's undo is already a failure
                faults.undo_pool_full()
        server.stop(grace_s=90)
        pool.shutdown()
        # Unreachable cycles first: a put that failed while a client restarted leaves a
        # traceback whose frames hold a view of the Pool's transfer window (and so its
        # memory file's descriptor) until the collector runs. A hold still reachable
        # after this is a leak, and is reported.
        gc.collect()
        fds_after = len(os.listdir("/proc/self/fd"))
        fd_targets = open_descriptors() - fd_targets_before
        ray.shutdown()
    load_s = time.monotonic() - t0

    # ---- checks ----------------------------------------------------------------------
    wrong = [r for r in results if "error" not in r and not r["ok"]]
    errors = [r for r in results if "error" in r]
    slow = [r for r in results if r["total_s"] > args.max_request_s]
    if wrong:
        failures.append(f"{len(wrong)} requests returned other tokens than the oracle")
    if errors:
        failures.append(f"{len(errors)} requests failed (first: {errors[0]['error']})")
    if slow:
        failures.append(f"{len(slow)} requests took longer than {args.max_request_s} s")
    by_kind = {
        k: {
            "injected": sum(1 for f in fault_log if f["kind"] == k and f["ok"]),
            "not_shown": sum(1 for f in fault_log if f["kind"] == k and not f["ok"]),
        }
        for k in kinds
    }
    never = [k for k, n in by_kind.items() if not n["injected"]]
    if never and all(f["ok"] for f in fault_log):
        failures.append(
            f"never injected: {', '.join(never)} (lengthen --max-duration or shorten --fault-every)"
        )
    blocks, recomputed = blocks_by_fault(results, fault_log, lines, kinds)
    missed = r'vllm:kvray_missed_blocks_total\{[^}]*reason="(\w+)"[^}]*\} ([0-9.e+]+)'
    misses = {m.group(1): float(m.group(2)) for m in re.finditer(missed, metrics)}
    time.sleep(1)
    leftover_procs = [p.pid for p in psutil.Process().children(recursive=True) if p.is_running()]
    leftover_shm = sorted(shm_entries() - shm_before)
    if leftover_procs:
        failures.append(f"processes left: {leftover_procs}")
    if leftover_shm:
        failures.append(f"/dev/shm files left: {leftover_shm}")
    # Sockets: Ray's driver keeps gRPC channels to actor processes it called; those left
    # after the pool's shutdown are counted and listed, not failed (not attributed here).
    left_files = sorted(t for t in fd_targets if not t.startswith("socket:"))
    if left_files:
        failures.append(f"descriptors left: {left_files}")
    shutil.rmtree(tmp, ignore_errors=True)

    summary: Row = {
        "meta": run_meta(
            pool_checksum=pool_checksum,
            prompts=len(prompts),
            **{k: v for k, v in vars(args).items() if k not in ("json", "requests_json", "kinds")},
        ),
        "oracle": oracle_from,
        "load_s": round(load_s, 3),
        "requests": {
            "total": len(results),
            "completed": len(results) - len(errors),
            "wrong": len(wrong),
            "failed": len(errors),
            "slow": len(slow),
            "worst_s": round(max((r["total_s"] for r in results), default=0), 4),
        },
        "ttft_s": percentiles([r["ttft_s"] for r in results if r.get("ttft_s") is not None]),
        "faults": fault_log,
        "faults_by_kind": by_kind,
        "blocks": blocks,
        "recomputed_after": recomputed,
        "misses": misses,
        "corrupt": {
            "dram": pool_stats.total.get_corrupt,
            "ssd": pool_stats.total.ssd_corrupt,
            "dram_after": per_window(fault_log, corrupt_at, pool_stats.total.get_corrupt),
        },
        "left_behind": {
            "processes": leftover_procs,
            "shm_files": leftover_shm,
            "files": left_files,
            "driver_sockets": len(fd_targets) - len(left_files),
            "fds_before": fds_before,
            "fds_after": fds_after,
        },
        "problem_requests": (wrong + errors + slow)[:20],
        "failures": failures,
        "pool": pool_stats.to_dict(),
    }
    print_report(summary)
    for path, doc in (
        (args.json, summary),
        (args.requests_json, {"meta": summary["meta"], "requests": results}),
    ):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
