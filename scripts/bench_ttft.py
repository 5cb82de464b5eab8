"""TTFT benchmark: KVRayConnector against full compute, vLLM's own prefix cache (the
ideal: the prefix is already resident, nothing to transfer) and vLLM's
MooncakeStoreConnector on the same Mooncake master settings.

For each input length and pool hit rate h, a request's first h of tokens (whole
blocks) were computed before by another request (the seed), and its TTFT (one generated
token, alone in the engine) is measured. Configurations, each a live vLLM engine (its
own process, up for the whole run):

- ``full``: no connector, prefix caching off: everything is computed;
- ``local``: vLLM prefix caching on, prefix resident in the engine (the ideal);
- ``kvray``: KVRayConnector, prefix caching off: the prefix comes from the kvray pool
  (``shared`` placement: the KV cache is the shared region);
- ``staged`` (``--configs ...,staged`` or ``--placement staged``): the same through the
  ``staged`` placement (blocks gathered into and scattered from a staging region: the
  GPU/NPU path), so its overhead over ``shared`` shows;
  With ``local`` beside it, every rep also times a memcpy of the hit's bytes in this
  process (the engines paused), and the table shows staged - ideal - floor per row, the
  floor being that memcpy times :data:`STAGED_COPIES`;
- ``peer``: vLLM's MooncakeStoreConnector (embedded mode: an in-process Mooncake client,
  its own mooncake_master with the pool master's settings), prefix caching off;
- ``index`` (``--configs ...,index``): ``kvray`` on a second pool with ``lookup_index:
  true``: lookups answered from the node's block index in the scheduler's process, with
  no call (the table then shows index - kvray per row: what the lookup's round trip
  cost, median of paired differences with its 95 % interval).
- ``actor`` (``--configs ...,actor``): ``kvray`` on a pool with ``lookup_index: false``:
  every lookup a call to the node's Lookup actor (kvray - actor-lookups per row: what the
  index saves).
- ``raycall`` (``--configs ...,raycall``): ``kvray`` with ``transfer_channel: ray``, every
  load and save a Ray actor call as before the node channel (kvray - ray-calls per row:
  what the channel saves).
- ``nice0`` (``--configs ...,nice0``): ``kvray`` on a pool with ``save_niceness: 0``, its
  stores (Mooncake's copy thread included) at the engine's priority: kvray - nice0 is what
  the default's yielding stores save (``nice10``: at 10).
- ``nosave`` (``--configs ...,nosave --rates 0``): ``kvray`` as a PD consumer that loads
  (``kv_role: kv_consumer``, ``consumer_is_to_load``), which looks up and loads but
  stores nothing: on rows without hits, nosave - full is what the connector costs a miss
  apart from its saves, and kvray - nosave what the saves cost it.
- ``async`` (``--configs ...,async``): ``kvray`` with ``load_async: true``, the hit's
  blocks loaded in a step of their own (the request waits in vLLM's
  ``WAITING_FOR_REMOTE_KVS`` meanwhile) and its forward in the next: async - kvray is
  what that costs a request alone in the engine.

Paired differences (median over reps of per-rep differences, 95 % interval) are printed
for each of index - kvray, kvray - actor-lookups, kvray - ray-calls, kvray - ideal,
index - ideal and kvray - full (on the 0 % rows: a miss's cost) whose two configurations
ran.

Reps are interleaved: for every (input length, hit rate, rep) each engine in turn, in
an order rotated per rep, seeds the prefix and times one request that starts with it;
engines not in turn are paused (SIGSTOP) so their background threads take no CPU from
the one measured. Every rep is recorded (JSON: every rep's TTFT and vLLM's count of
prompt tokens it did not compute, the commit, the machine); the table shows medians and
their spread. Each measured request is checked: with hits, every caching configuration
must have skipped at least the prefix (vLLM's ``num_cached_tokens``), ``full`` nothing;
otherwise the run is void and fails.

The model is a locally built Llama with dummy-sized compute (random weights) so that
prefill dominates as on real hardware. ``--family gemma3``: a hybrid-attention model of
the same sizes (three of four layers attend to a 512-token sliding window: four KV cache
groups, vLLM's hybrid allocator on in every configuration but ``hmaoff``: kvray on an
engine with it off, one group of every layer, what a connector without ``SupportsHMA``
gets); its seed is the prefix and one token (vLLM's own cache keeps only the window before
a prompt's end), kvray loads asynchronously (as it must for such models), and the table
adds the bytes each kvray configuration loaded per hit and stored per turn (the pool's
``get_bytes`` and ``put_bytes`` around each turn) and each engine's KV cache size in
tokens (vLLM's log line), and kvray's hit is compared with the ideal plus the time of one
memcpy and one xxh3-64 of the bytes it loaded. ``--family qwen3_next``: a Gated DeltaNet
hybrid of the same sizes (bfloat16; three state groups and one full): vLLM keeps states
per block boundary only with prefix caching on, so kvray's engines run with it on and
their own cache is emptied before each probe; hits are multiples of the block size vLLM
grows for the states. ``--back-to-back``: each probe is sent as soon as its seed returned
(the seed's saves in flight, as users send requests), every configuration seeding, a
miss's seed an unrelated prompt.

    .venv/bin/python scripts/bench_ttft.py --json bench-results/bench_ttft.json
    .venv/bin/python scripts/bench_ttft.py --placement staged --configs full,local,kvray
    .venv/bin/python scripts/bench_ttft.py --smoke --json /tmp/bench_ttft.json
    .venv/bin/python scripts/bench_ttft.py --family gemma3 --configs full,local,kvray,hmaoff \
        --json bench-results/bench_ttft_gemma3.json
    .venv/bin/python scripts/bench_ttft.py --family qwen3_next --configs full,local,kvray \
        --json bench-results/bench_ttft_qwen3_next.json
    .venv/bin/python scripts/bench_ttft.py --back-to-back --configs full,kvray,peer \
        --rates 0,0.5,0.9 --lengths 1024,4096 --reps 30 --json bench-results/bench_ttft_b2b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import log, parse  # noqa: E402
from _cpu import PartsMeter, cpu_rows, print_cpu, print_cpu_parts  # noqa: E402
from _engines import (  # noqa: E402
    FAMILIES,
    PEER_TRANSFER_CONFIG,
    SMOKE_POOL_MEMORY,
    bench_model,
    bench_pool,
    chosen,
    engine_env,
    interleaved,
    kvray_transfer_config,
    live_engines,
    prestart_fork_servers,
    run_meta,
    start_bench_pool,
    start_engines,
    start_peer_master,
    workload,
    workload_args,
)
from _floors import STAGED_COPIES, CopyVerifyFloor, StagedFloor  # noqa: E402
from _stats import paired_difference_ms, paired_ratio, pct  # noqa: E402

CONFIGS = (
    "full", "local", "kvray", "staged", "peer", "nock", "index", "raycall", "actor", "hmaoff",
    "nice10", "nice0", "lazyseg", "nosave", "async",
)  # fmt: skip
DEFAULT_CONFIGS = "full,local,kvray,peer"
LABELS = {
    "full": "full",
    "local": "ideal",
    "kvray": "kvray",
    "staged": "staged",
    "peer": "peer",
    "nock": "no-cksum",
    "index": "index",
    "raycall": "ray-calls",
    "actor": "actor-lookups",
    "hmaoff": "kvray-hma-off",
    "nice10": "kvray-saves-nice-10",
    "nice0": "kvray-saves-nice-0",
    "lazyseg": "kvray-lazy-segment",
    "nosave": "kvray-loads-only",
    "async": "kvray-async-loads",
}
PAIRS = (
    ("index", "kvray"),
    ("kvray", "actor"),
    ("kvray", "raycall"),
    ("kvray", "local"),
    ("index", "local"),
    ("kvray", "full"),
    ("kvray", "peer"),
    ("peer", "full"),
    ("nice10", "full"),
    ("kvray", "nice0"),
    ("nice0", "full"),
    ("kvray", "lazyseg"),
    ("nosave", "full"),
    ("kvray", "nosave"),
    ("async", "kvray"),
    ("async", "local"),
    ("async", "peer"),
)
"""The paired differences printed, where both configurations ran (kvray - full on the
0 % rows: what a miss costs over an engine with no connector; kvray - peer and peer -
full beside it)."""
OWN_POOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "nock": ("bench-nock", {"checksum": False}),
    "index": ("bench-ix", {"lookup_index": True}),
    "actor": ("bench-actor", {"lookup_index": False}),
    "hmaoff": ("bench-hmaoff", {}),
    "nice10": ("bench-nice10", {"save_niceness": 10}),
    "nice0": ("bench-nice0", {"save_niceness": 0}),
    "lazyseg": ("bench-lazyseg", {"mooncake": {"prefault_segment": False}}),
}
"""Configurations that run kvray's engine on a pool of their own: its name and its
settings over the defaults. nock: without block checksums (their cost: kvray / nock);
index: lookup_index set (now the default); actor: lookups as calls to the Lookup actor;
hmaoff: its own pool only (its blocks beside kvray's would evict the seeds'); nice10 and
nice0: save_niceness 10 and 0 (the default is 19); lazyseg: the Mooncake segment mapped
as stores write it."""
BLOCK = 128
SMOKE = ["--lengths", "256", "--rates", "0,0.5", "--reps", "3", "--kv-cache-gb", "1",
         "--pool-memory", SMOKE_POOL_MEMORY]  # fmt: skip
"""``--smoke``: every configuration, one short input with and without hits, 3 reps; the
engines started together, without their warm-up request (``start_engines``)."""


STATE_FAMILIES = ("qwen3_next",)
"""Families with state groups (Gated DeltaNet): vLLM keeps a state per block boundary only
with prefix caching on, so kvray's engines run with it on, and their own prefix cache is
emptied between the seed and the probe (the probe's hit can only come from the pool)."""


def miss_twin(length: int, rep: int) -> list[int]:
    """A back-to-back miss's twin: unrelated tokens of the same length (every engine of
    the rep gets the same)."""
    import numpy as np

    tokens: list[int] = (
        np.random.default_rng([length, rep, 0x7717]).integers(3, 1000, length).tolist()
    )
    return tokens


def twin_rows(
    row: dict[str, Any],
    reps: dict[tuple[str, int, float], list[float]],
    configs: list[str],
    length: int,
    rate: float,
) -> None:
    """A back-to-back miss row's calibration: each configuration's twin per rep
    (``reps_twin_<c>_s``), and for each but no connector what the pool's work in flight
    cost its probe: per rep (probe - twin) of it minus (probe - twin) of no connector
    (``<c>_inflight_cost_ms``). Each engine is its own baseline there, so what one
    engine process computes faster or slower than another (seen: 25 % between two
    engines of one run) drops out; what a request costs the connector on every miss
    (its lookup, the hooks) drops out too: ``<c>_minus_full_ms`` keeps it."""
    for c in configs:
        row[f"reps_twin_{c}_s"] = reps[(f"twin_{c}", length, rate)]
    own = {
        c: [p - t for p, t in zip(row[f"reps_{c}_s"], row[f"reps_twin_{c}_s"], strict=True)]
        for c in configs
    }
    for c in configs:
        if c != "full":
            row[f"{c}_inflight_cost_ms"] = paired_difference_ms(own[c], own["full"])


def engine_spec(name: str, model: str, max_len: int, family: str = "llama") -> dict[str, Any]:
    states = family in STATE_FAMILIES
    spec: dict[str, Any] = {"model": model, "max_len": max_len, "prefix_caching": name == "local"}
    if states:
        spec["dtype"] = "bfloat16"  # (vLLM's CPU GDN kernel needs it)
    if name in ("kvray", "staged", "raycall", "nosave", "async") or name in OWN_POOLS:
        spec["prefix_caching"] = states
        extra = {
            "pool_name": OWN_POOLS[name][0] if name in OWN_POOLS else "bench",
            # (a hybrid model's loads are async: vLLM takes their failures per request only;
            # else the default, whose lone hit loads before its forward)
            **({"load_async": True} if family != "llama" or name == "async" else {}),
            "kv_placement": "staged" if name == "staged" else "shared",
            "model_namespace": f"bench-{name}",  # each configuration seeds its own blocks
        }
        if name == "raycall":
            extra["transfer_channel"] = "ray"
        role = "kv_both"
        if name == "nosave":  # (a PD consumer that loads: it looks up and loads, stores nothing)
            extra["consumer_is_to_load"] = True
            role = "kv_consumer"
        if name == "hmaoff":  # vLLM's hybrid allocator off: one group, sliding layers whole
            spec["hma"] = False
        spec["kv_transfer_config"] = kvray_transfer_config(extra, role)
    elif name == "peer":
        spec["kv_transfer_config"] = PEER_TRANSFER_CONFIG
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(parser, "1024,2048,4096", "0,0.5,0.9")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"from {','.join(CONFIGS)}")
    parser.add_argument(
        "--placement",
        choices=("shared", "staged"),
        default="shared",
        help="staged: also run KVRayConnector with kv_placement staged (config 'staged')",
    )
    parser.add_argument("--kv-cache-gb", type=int, default=2, help="each engine's KV cache")
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="the model's family")
    args = parse(parser, SMOKE)
    configs = args.configs.split(",")
    if args.placement == "staged" and "staged" not in configs:
        configs.append("staged")
    chosen(parser, configs, CONFIGS)
    if "full" not in configs:
        parser.error("--configs must include full (the baseline of every saving)")
    lengths, rates = workload(parser, args, misses=True)
    if args.family in STATE_FAMILIES and {"hmaoff", "peer"} & set(configs):
        parser.error(f"--family {args.family}: hmaoff and peer do not run state groups here")
    if "nosave" in configs and any(r > 0 for r in rates):
        parser.error("--configs nosave stores nothing, so its probes cannot hit: use --rates 0")
    if args.family in STATE_FAMILIES and configs == ["full"]:
        parser.error(f"--family {args.family}: --configs needs a caching configuration")

    from kvray.config import MooncakeMasterConfig

    tmp = Path(tempfile.mkdtemp(prefix="kvray-bench-ttft-"))
    # A smoke run's fork server imports vLLM while Ray and the pools start (the peer's,
    # of another environment, while the other engines start).
    prestart_fork_servers([engine_env(tmp, None, kv_cache_gb=args.kv_cache_gb)], tmp)
    model = bench_model(args.model_dir, args.family)
    hybrid = args.family != "llama"
    master = MooncakeMasterConfig().model_dump()  # the same flags for the pool's and the peer's
    # Every pool and the peer's master hold SEGMENT: a default run stores ~2.6 GB of
    # blocks (the seeds' and probes' of every row), past which the master evicts and
    # refuses puts, and a probe's seed can be gone before the probe (the run is void).
    pool, ray_address = start_bench_pool(segment=args.pool_memory, master=master)
    stops = [pool.shutdown]
    pools = {"kvray": pool}
    for name, (pool_name, setting) in OWN_POOLS.items():
        if name in configs:
            pools[name] = bench_pool(pool_name, args.pool_memory, "256MB", master, **setting)
            stops.append(pools[name].shutdown)
    env = engine_env(tmp, ray_address, kv_cache_gb=args.kv_cache_gb)
    reps: dict[tuple[str, int, float], list[float]] = {}
    splits: dict[tuple[str, int, float], list[dict[str, float]]] = {}
    """(cpu_parts_<config> | cpu_threads_<config>, length, rate) -> per rep, CPU seconds by
    process kind | thread."""
    short: dict[tuple[str, int, float], list[int]] = {}
    b2b = bool(args.back_to_back)
    cached: dict[tuple[str, int, float], list[int]] = {}
    with live_engines(tmp, stops) as engines:
        specs = {
            name: (engine_spec(name, model, max(lengths) + 16, args.family), env)
            for name in configs
        }
        if "peer" in configs:
            peer_master, peer_env = start_peer_master(
                tmp, master, segment=args.pool_memory, local_buffer=256 << 20
            )
            stops.insert(0, peer_master.stop)
            specs["peer"] = (specs["peer"][0], {**env, **peer_env})
        start_engines(engines, specs, tmp, args.smoke)
        floor = StagedFloor(model, max(lengths)) if {"staged", "local"} <= set(configs) else None
        total = len(lengths) * len(rates) * args.reps
        tail = 1 if hybrid else None
        block = BLOCK
        if args.family in STATE_FAMILIES:  # (vLLM grows it so an attention page holds a state)
            # (a caching engine's: with prefix caching off, as ``full`` runs, vLLM keeps no
            # states per block and sizes its blocks otherwise)
            first = engines[next(n for n in configs if n != "full")]
            block = int(first.call(op="block_size")["block_size"])
            first.pause()
            log(f"   {args.family}: vLLM's block size {block}")
        schedule = interleaved(configs, lengths, rates, args.reps, block, seed_tail=tail)
        capacity = {name: kv_capacity(engines[name].log()) for name in configs}
        cv = CopyVerifyFloor()
        meter = PartsMeter()
        for done, (length, rate, rep, prefix_len, seed, probe, order) in enumerate(schedule, 1):
            # a back-to-back miss's twin: a like miss with nothing in flight, on each engine
            twin = miss_twin(length, rep) if b2b and not prefix_len else None
            for name in order:
                # back to back: every configuration seeds, a miss's seed unrelated to it
                needs_seed = args.back_to_back or (prefix_len > 0 and name != "full")
                moved = (hybrid or b2b) and name in MOVED
                before = pools[name].stats().total if moved else None
                cpu0 = meter.snapshot() if b2b else {}
                answer = engines[name].turn(
                    seed if needs_seed else None,
                    probe,
                    back_to_back=args.back_to_back,
                    reset_own=args.family in STATE_FAMILIES and name != "local",
                    twin=twin,
                )
                if twin is not None:
                    reps.setdefault((f"twin_{name}", length, rate), []).append(
                        answer["twin_ttft_s"]
                    )
                if b2b:  # (the turn drained its probe's saves: its CPU is in)
                    parts, threads = meter.parts_since(cpu0)
                    reps.setdefault((f"cpu_{name}", length, rate), []).append(sum(parts.values()))
                    splits.setdefault((f"cpu_parts_{name}", length, rate), []).append(parts)
                    splits.setdefault((f"cpu_threads_{name}", length, rate), []).append(threads)
                if before is not None:
                    after = pools[name].stats().total
                    reps.setdefault((f"get_{name}", length, rate), []).append(
                        after.get_bytes - before.get_bytes
                    )
                    reps.setdefault((f"put_{name}", length, rate), []).append(
                        after.put_bytes - before.put_bytes
                    )
                whole = check_cached(
                    name, answer["cached_tokens"], prefix_len, length, back_to_back=b2b
                )
                if b2b:
                    short.setdefault((name, length, rate), []).append(0 if whole else 1)
                reps.setdefault((name, length, rate), []).append(answer["ttft_s"])
                if before is not None and name == "kvray":  # the hit's copy-and-verify floor
                    loaded = int(reps[(f"get_{name}", length, rate)][-1])
                    reps.setdefault(("copyverify", length, rate), []).append(cv.time(loaded))
                cached.setdefault((name, length, rate), []).append(answer["cached_tokens"])
            if floor:
                reps.setdefault(("floor", length, rate), []).append(floor.time(prefix_len))
            last = "  ".join(f"{n} {reps[(n, length, rate)][-1] * 1e3:7.1f}" for n in configs)
            log(f"   [{done}/{total}] input {length} hit {rate:.0%} rep {rep}: {last} ms")

    rows = []
    for length in lengths:
        for rate in rates:
            row: dict[str, Any] = {"input_tokens": length, "hit_rate": rate}
            for name in configs:
                times = reps[(name, length, rate)]
                row[f"ttft_{name}_s"] = statistics.median(times)
                row[f"reps_{name}_s"] = times
                row[f"cached_tokens_{name}"] = cached[(name, length, rate)]
                if b2b:  # probes that found less than the prefix (the seed's saves in flight)
                    row[f"short_hits_{name}"] = sum(short[(name, length, rate)])
            for name in MOVED:
                if (f"get_{name}", length, rate) in reps:
                    got = reps[(f"get_{name}", length, rate)]
                    put = reps[(f"put_{name}", length, rate)]
                    row[f"reps_loaded_bytes_{name}"] = got
                    row[f"loaded_bytes_{name}"] = statistics.median(got)
                    row[f"reps_stored_bytes_{name}"] = put
                    row[f"stored_bytes_{name}"] = statistics.median(put)
            if b2b and "full" in configs:
                cpu_rows(row, reps, splits, configs, length, rate)
            if ("twin_full", length, rate) in reps:
                twin_rows(row, reps, configs, length, rate)
            if floor:
                row["reps_floor_s"] = floors = reps[("floor", length, rate)]
                pairs = zip(row["reps_staged_s"], row["reps_local_s"], strict=True)
                over = [staged - local for staged, local in pairs]
                row["staged_minus_local_minus_floor_ms"] = paired_difference_ms(over, floors)
            if ("copyverify", length, rate) in reps and "local" in configs:
                row["reps_copyverify_s"] = floors = reps[("copyverify", length, rate)]
                pairs = zip(row["reps_kvray_s"], row["reps_local_s"], strict=True)
                over = [kvray - local for kvray, local in pairs]
                row["kvray_minus_local_minus_copyverify_ms"] = paired_difference_ms(over, floors)
            if "nock" in configs and "kvray" in configs:
                row["checksum_cost"] = paired_ratio(row["reps_kvray_s"], row["reps_nock_s"])
            for a, b in PAIRS:
                if a in configs and b in configs:
                    row[f"{a}_minus_{b}_ms"] = paired_difference_ms(
                        row[f"reps_{a}_s"], row[f"reps_{b}_s"]
                    )
            rows.append(row)
    print_table(rows, configs)
    if b2b:
        print("\nprobes that skipped less than the prefix (the seed's saves still in flight), "
              "per configuration: " + "; ".join(
                  f"{r['input_tokens']}/{r['hit_rate']:.0%} "
                  + " ".join(f"{LABELS[c]} {r[f'short_hits_{c}']}" for c in configs)
                  for r in rows if r["hit_rate"]))  # fmt: skip
    if b2b and any(f"{c}_inflight_cost_ms" in r for r in rows for c in configs):
        print_paired_each(
            rows, configs, "inflight_cost_ms", "in flight",
            "in flight = median over reps of (probe - twin) of the configuration minus (probe "
            "- twin) of no connector, paired; twin = a like miss timed on the same engine "
            "after the probe's saves drained: what the pool's work in flight cost the probe, "
            "each engine its own baseline",
        )  # fmt: skip
    if b2b:
        print_cpu(rows, configs)
        print_cpu_parts(rows, configs)
        print_cpu_parts(rows, configs, top=16, by="threads")
    if hybrid:
        print_family(rows, capacity, args.family)
        if all("kvray_minus_local_minus_copyverify_ms" in r for r in rows):
            print_paired(
                rows, "kvray_minus_local_minus_copyverify_ms", "kvray-ideal-cv",
                lambda v: f"{v:.2f}",
                "kvray - ideal - copy-and-verify = median over reps of TTFT(kvray) - "
                "TTFT(ideal) - (a memcpy and an xxh3-64 of the bytes kvray loaded, timed in "
                "the same rep): <= 0 meets the hit target's second bound",
            )  # fmt: skip
    if "nock" in configs and "kvray" in configs:
        print_checksum_cost(rows)
    for a, b in PAIRS:
        if a in configs and b in configs:
            print_difference(rows, a, b)
    if floor:
        print_paired(
            rows, "staged_minus_local_minus_floor_ms", "staged-ideal-floor", lambda v: f"{v:.2f}",
            f"staged - ideal - floor = median over reps of TTFT(staged) - TTFT(ideal) - "
            f"{STAGED_COPIES} x a memcpy of the hit's bytes timed in the same rep (target <= 3 ms)",
        )  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = run_meta(
            reps=args.reps,
            configs=configs,
            **({"family": args.family, "kv_capacity_tokens": capacity} if hybrid else {}),
            order="interleaved: per (length, rate, rep) every config in turn, order rotated "
            "per rep; engines not in turn paused (SIGSTOP)",
            **(
                {"probe": "back to back: sent as soon as its seed returned, every config seeding"}
                if args.back_to_back
                else {}
            ),
            checks="every measured request: caching configs skipped >= the prefix "
            "(num_cached_tokens), full skipped nothing",
        )
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        plot(rows, args.json.with_suffix(".png"))
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


MOVED = ("kvray", "hmaoff")
"""The configurations whose bytes a hybrid run records: their pool's ``get_bytes`` (the
probe's load) and ``put_bytes`` (the seed's and probe's saves) around each turn, which no
other configuration's requests touch (``hmaoff`` has a pool of its own)."""


def kv_capacity(log_text: str) -> int | None:
    """The engine's KV cache capacity in tokens, as vLLM logs it at startup."""
    import re

    found = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
    return int(found.group(1).replace(",", "")) if found else None


def print_family(rows: list[dict[str, Any]], capacity: dict[str, int | None], family: str) -> None:
    """A hybrid family's extra columns: what kvray loaded per hit, and the engines' KV
    capacity (vLLM's hybrid allocator on with kvray as without a connector)."""
    names = [n for n in MOVED if f"loaded_bytes_{n}" in rows[-1]]
    print(f"\n{family}: MB loaded per hit and stored per turn (median over reps)")
    head = "".join(f" {LABELS[n] + ' loaded':>22} {LABELS[n] + ' stored':>22}" for n in names)
    print(f"{'input':>6} {'hit':>5}{head}")
    for r in rows:
        cells = "".join(
            f" {r[f'loaded_bytes_{n}'] / 1e6:>22.2f} {r[f'stored_bytes_{n}'] / 1e6:>22.2f}"
            for n in names
        )
        print(f"{r['input_tokens']:>6} {r['hit_rate']:>5.0%}{cells}")
    shown = ", ".join(f"{n} {c if c is not None else '?'}" for n, c in capacity.items())
    print(f"KV cache capacity in tokens (vLLM's log): {shown}")


def print_paired(rows: list[dict[str, Any]], key: str, title: str, show: Any, note: str) -> None:
    """One paired comparison per row (``row[key]``: a median over reps and its 95 %
    bootstrap interval), each value shown by ``show``."""
    print(f"\n{'input':>6} {'hit':>5} {title:>17} {'95% CI':>17} {'pairs':>6}")
    for r in rows:
        c = r[key]
        lo, hi = c["ci95"]
        print(
            f"{r['input_tokens']:>6} {r['hit_rate']:>5.0%} {show(c['median']):>17} "
            f"{'[' + show(lo) + ', ' + show(hi) + ']':>17} {c['pairs']:>6}"
        )
    if note:
        print(note)


def print_paired_each(
    rows: list[dict[str, Any]], configs: list[str], suffix: str, title: str, note: str
) -> None:
    """``<config>_<suffix>`` of every configuration that has it, on the rows that have it."""
    for c in configs:
        have = [r for r in rows if f"{c}_{suffix}" in r]
        if have:
            print_paired(have, f"{c}_{suffix}", f"{LABELS[c]} {title} ms", lambda v: f"{v:.2f}", "")
    print(note)


def print_checksum_cost(rows: list[dict[str, Any]]) -> None:
    """What block checksums add to TTFT: per row, the median of the per-rep ratios kvray
    (checksums on, the default) / no-cksum (the same engine config on a pool without),
    with its 95 % bootstrap interval."""
    print_paired(
        rows, "checksum_cost", "checksum cost", pct,
        "checksum cost = median over reps of TTFT(kvray) / TTFT(no-cksum) - 1 (paired: the "
        "reps ran interleaved); 0 % hit rows: the save side",
    )  # fmt: skip


def print_difference(rows: list[dict[str, Any]], a: str, b: str) -> None:
    """Per row, the median of the per-rep TTFT differences ``a`` - ``b`` (interleaved
    reps: paired), with its 95 % bootstrap interval."""
    la, lb = LABELS[a], LABELS[b]
    print_paired(
        rows, f"{a}_minus_{b}_ms", f"{la} - {lb} ms", lambda v: f"{v:.2f}",
        f"{la} - {lb} = median over reps of TTFT({la}) - TTFT({lb}), paired (interleaved)",
    )  # fmt: skip


def check_cached(
    name: str, cached: int, prefix_len: int, length: int, *, back_to_back: bool = False
) -> bool:
    """A caching configuration that did not skip the prefix (or ``full`` that skipped
    anything) measured something else than it claims: the run is void. Back to back, a
    pool's probe may find the seed's saves still in flight, as users' requests do: its
    short hit is what it measured (False: counted, shown), not a void run."""
    # vLLM never counts the last prompt token as cached: it must compute one.
    ok = cached == 0 if name == "full" else min(prefix_len, length - 1) <= cached
    if not ok and back_to_back and name not in ("full", "local"):
        return False
    if not ok:
        raise RuntimeError(
            f"{name}: a measured request skipped {cached} of {length} prompt tokens where the "
            f"prefix is {prefix_len} ({'none expected' if name == 'full' else 'all expected'}): "
            "results void"
        )
    return True


def print_table(rows: list[dict[str, Any]], configs: list[str]) -> None:
    def ms(row: dict[str, Any], name: str) -> str:
        key = f"ttft_{name}_s"
        if key not in row:
            return f"{'-':>15}"
        times = row[f"reps_{name}_s"]
        spread = (max(times) - min(times)) / row[key]
        return f"{row[key] * 1e3:9.1f} ±{spread / 2:4.0%}"

    def saving(row: dict[str, Any], name: str) -> str:
        ideal = row["ttft_full_s"] - row.get("ttft_local_s", float("nan"))
        key = f"ttft_{name}_s"
        if row["hit_rate"] == 0 or key not in row or not ideal > 0:
            return f"{'-':>8}"
        return f"{(row['ttft_full_s'] - row[key]) / ideal:8.2f}"

    savers = [n for n in ("kvray", "staged", "peer", "index", "raycall", "actor") if n in configs]
    print()
    print(
        f"{'input':>6} {'hit':>5} "
        + " ".join(f"{LABELS[n] + ' ms':>15}" for n in configs)
        + "".join(f" {LABELS[n] + ' sv':>8}" for n in savers)
    )
    for r in rows:
        print(
            f"{r['input_tokens']:>6} {r['hit_rate']:>5.0%} "
            + " ".join(ms(r, n) for n in configs)
            + "".join(f" {saving(r, n)}" for n in savers)
        )
    print(
        "\nmedian TTFT ± half the range of its reps, relative; sv = saving = "
        "(full - x) / (full - ideal), medians; targets: kvray saving >= 0.9 in every row "
        "with hits, kvray TTFT <= peer TTFT"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["input_tokens"] for r in rows})
    rates = sorted({r["hit_rate"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        sel = [r for r in rows if r["hit_rate"] == rate]
        for key, label in (
            ("ttft_full_s", "full compute"),
            ("ttft_local_s", "vLLM prefix cache (ideal)"),
            ("ttft_kvray_s", "KVRayConnector"),
            ("ttft_staged_s", "KVRayConnector (staged)"),
            ("ttft_peer_s", "MooncakeStoreConnector"),
        ):
            if all(key in r for r in sel):
                ax.plot(lengths, [r[key] * 1e3 for r in sel], marker="o", label=label)
        ax.set_title(f"pool hit rate {rate:.0%}")
        ax.set_xlabel("input tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
