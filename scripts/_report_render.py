"""The renderers of scripts/report.py, one per kind of result: each reads its JSON files
under bench-results/ and returns the Markdown of a block, ending with the commit each
result was measured at."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from _cpu import largest
from _report_format import Results, ci, f, measured_at, meta, pct_ci, ratio_ci, spread, table
from _stats import paired_difference_ms

LABELS = {
    "full": "full (no connector)",
    "local": "ideal (vLLM prefix cache)",
    "kvray": "kvray",
    "staged": "kvray staged",
    "peer": "MooncakeStoreConnector",
    "nock": "kvray, no checksums",
    "index": "kvray index",
    "raycall": "kvray, Ray calls",
    "actor": "kvray, Lookup actor",
    "hmaoff": "kvray, hybrid allocator off",
    "nice10": "kvray, saves at niceness 10",
    "nice0": "kvray, saves at niceness 0",
    "lazyseg": "kvray, segment mapped as stores write it",
    "nosave": "kvray, loads only (stores nothing)",
    "async": "kvray, async loads",
}
"""bench_ttft.py's configurations, as the tables name them."""

# --- store -----------------------------------------------------------------------------

STORE_PATHS = (
    "raw",
    "raw x4",
    "kvray",
    "kvray checksum",
    "kvray staged",
    "raw multi",
    "raw multi x4",
    "kvray multi",
    "kvray multi checksum",
    "memcpy",
    "memcpy x4",
    "memcpy checksum",
)


def _raw_paths(paths: Iterable[str], multi: bool) -> list[str]:
    """The raw client's paths of one shape (one piece per block, or ``multi``): one call
    and the split over threads (``raw xN``)."""
    return [p for p in paths if p.startswith("raw") and ("multi" in p) == multi]


def _vs_raw(gbps: dict[str, dict[str, float]], path: str, op: str) -> str:
    if not path.startswith("kvray"):
        return ""
    strongest = max(gbps[s][op] for s in _raw_paths(gbps, "multi" in path))
    return f"{gbps[path][op] / strongest:.2f}"


def render_store(results: Results, names: Sequence[str]) -> str:
    """bench_store.py: GB/s per path and backend, kvray against the stronger raw path of
    its shape (one native call, or split over 4 threads)."""
    runs = [results(n) for n in names]
    header = ["path"]
    for run in runs:
        backend = run["params"]["backend"]
        header += [f"{backend} put / get GB/s", "vs raw (put / get)"]
    rows = []
    for path in STORE_PATHS:
        row = [path]
        for run in runs:
            g = run["gbps"].get(path)
            if g is None:
                row += ["-", ""]
                continue
            vs = f"{_vs_raw(run['gbps'], path, 'put')} / {_vs_raw(run['gbps'], path, 'get')}"
            if path == "memcpy checksum":  # the floor: a copy with the digests, vs a copy
                plain = run["gbps"]["memcpy"]
                vs = f"{g['put'] / plain['put']:.2f} / {g['get'] / plain['get']:.2f} of memcpy"
            elif not path.startswith("kvray"):
                vs = ""
            row += [f"{g['put']:.2f} / {g['get']:.2f}", vs]
        rows.append(row)
    return table(header, rows) + "\n\n" + measured_at(results, names)


def render_lookup(results: Results, names: Sequence[str]) -> str:
    """bench_store.py's 1000-block lookup: the node's index as the scheduler probes it,
    and a call to the node's Lookup actor."""
    rows = []
    for name in names:
        run = results(name)
        lk = run["lookup_ms"]
        rows.append(
            [
                run["params"]["backend"],
                f"{lk['index_p50']:.2f} / {lk['index_p99']:.2f}",
                f"{lk['p50']:.2f} / {lk['p99']:.2f}",
                f"{lk['ray_call_floor_p50']:.2f}",
                f"{lk['raw_exists_p50']:.2f}",
            ]
        )
    header = [
        "backend",
        "node index p50 / p99 ms",
        "Lookup actor p50 / p99 ms",
        "empty Ray call p50 ms",
        "backend's exists p50 ms",
    ]
    return table(header, rows) + "\n\n" + measured_at(results, names)


def render_cross_node(results: Results, names: Sequence[str]) -> str:
    """bench_store.py --cross-node: gets from another node's segment."""
    rows = []
    for name in names:
        run = results(name)
        p, g = run["params"], run["gbps"]
        raw, kv = g["raw_get_cross_node"], g["kvray_get_cross_node"]
        rows.append(
            [
                f"`{name}`",
                p["transport"],
                str(p["io_threads"]),
                f"{raw:.2f}",
                f"{kv:.2f}",
                f"{kv / raw:.2f}x",
            ]
        )
    header = ["result", "link", "io_threads", "raw GB/s", "kvray GB/s", "kvray / raw"]
    return table(header, rows) + "\n\n" + measured_at(results, names)


def render_store_checksum_hit(results: Results, names: Sequence[str]) -> str:
    """bench_store.py at a hit's size: the connector's multi-piece get with and without
    checksums, paired per rep, beside the raw client's multi-buffer get of the same bytes
    (the stronger of one call and the split over threads, by median)."""
    rows = []
    for name in names:
        run = results(name)
        p, reps = run["params"], run["reps_s"]
        mib = p["blocks"] * p["block_bytes"] / 2**20
        plain, checked = reps["kvray multi"]["get"], reps["kvray multi checksum"]["get"]
        raw = min((reps[k]["get"] for k in _raw_paths(reps, multi=True)), key=statistics.median)
        rows.append(
            [
                f"{p['blocks']} x {p['block_bytes'] // 2**20} MiB ({mib:.0f} MiB)",
                f(statistics.median(raw) * 1e3),
                f(statistics.median(plain) * 1e3),
                f(statistics.median(checked) * 1e3),
                ci(paired_difference_ms(checked, plain)),
                ci(paired_difference_ms(checked, raw)),
            ]
        )
    header = [
        "load",
        "raw client get ms",
        "get ms, no checksums",
        "get ms, checksums",
        "checksums - none ms, paired [95 % CI]",
        "checksums - raw ms, paired [95 % CI]",
    ]
    return table(header, rows) + "\n\n" + measured_at(results, names)


def render_ssd(results: Results, names: Sequence[str]) -> str:
    """bench_ssd.py: the SSD tier against raw file I/O (writes: the same durability)."""
    (name,) = names
    g = results(name)["gbps"]
    best_read = max(g[p]["read"] for p in ("raw", "raw x4", "raw x4 fsync"))
    base = {"kvray ssd": "raw x4", "kvray ssd fsync": "raw x4 fsync"}
    rows = []
    for path, v in g.items():
        w = v.get("write")
        vs = ""
        if path.startswith("kvray"):
            vs_w = f"{w / g[base[path]]['write']:.2f}" if path in base and w else "-"
            vs = f"{vs_w} / {v['read'] / best_read:.2f}"
        rows.append([path, f(w, 2), f(v["read"], 2), vs])
    header = ["path", "write GB/s", "read GB/s", "vs raw (write / read)"]
    return table(header, rows) + "\n\n" + measured_at(results, names)


def render_channel(results: Results, names: Sequence[str]) -> str:
    """bench_channel.py: a call to the node's BackendClient over the channel and as a
    Ray actor call."""
    (name,) = names
    run = results(name)
    rows = [
        [
            r["call"],
            f(r["ray_ms"]["p50"], 2),
            f(r["ray_ms"]["p99"], 2),
            f(r["channel_ms"]["p50"], 2),
            f(r["channel_ms"]["p99"], 2),
            ci(r["channel_minus_ray_ms"], 2),
        ]
        for r in run["rows"]
    ]
    header = [
        "call",
        "Ray p50 ms",
        "Ray p99 ms",
        "channel p50 ms",
        "channel p99 ms",
        "channel - Ray ms, paired [95 % CI]",
    ]
    fl = run["floor_ms"]
    note = (
        f"A bare socketpair round trip between two processes: {fl['p50']:.2f} ms p50, "
        f"{fl['p99']:.2f} ms p99. The BackendClient with a channel attached and no "
        f"calls: {run['idle_cpu_pct']:.1f} % of a core."
    )
    return table(header, rows) + "\n\n" + note + "\n\n" + measured_at(results, names)


# --- engines ---------------------------------------------------------------------------


def render_ttft(results: Results, names: Sequence[str]) -> str:
    """bench_ttft.py: medians per configuration (± half the range of the reps), the
    saving against the ideal, and every paired comparison the run recorded."""
    (name,) = names
    run = results(name)
    configs: list[str] = meta(run)["configs"]
    rows = run["rows"]
    paired = [k for k in rows[-1] if isinstance(rows[-1][k], dict) and "ci95" in rows[-1][k]]
    saving = (
        [c for c in configs if c not in ("full", "local")]
        if {"full", "local"} <= set(configs)
        else []
    )
    header = ["input", "hit"] + [f"{LABELS[c]} ms" for c in configs]
    header += [f"{LABELS[c]} saving" for c in saving]
    header += [_paired_label(k) for k in paired]
    moved = [c for c in configs if f"loaded_bytes_{c}" in rows[-1]]
    header += [f"{LABELS[c]} MB loaded, stored" for c in moved]
    out = []
    for r in rows:
        med = {c: r[f"ttft_{c}_s"] * 1e3 for c in configs}
        row = [str(r["input_tokens"]), f"{r['hit_rate']:.0%}"]
        row += [f"{med[c]:.1f} {spread(r[f'reps_{c}_s'])}" for c in configs]
        for c in saving:
            gain = med["full"] - med["local"]
            row.append(f"{(med['full'] - med[c]) / gain:.2f}" if r["hit_rate"] and gain else "-")
        for k in paired:
            d = r.get(k)
            row.append(_paired_cell(k, d))
        for c in moved:
            row.append(f"{r[f'loaded_bytes_{c}'] / 1e6:.2f}, {r[f'stored_bytes_{c}'] / 1e6:.2f}")
        out.append(row)
    notes = ""
    capacity = meta(run).get("kv_capacity_tokens")
    if capacity:
        shown = ", ".join(f"{LABELS[c]} {n:,}" for c, n in capacity.items() if n is not None)
        family = meta(run)["family"]
        notes = f"KV cache capacity in tokens (vLLM's log, model {family}): {shown}.\n\n"
    if meta(run).get("probe"):
        notes += f"Probes: {meta(run)['probe']}.\n\n"
        shorts = [
            f"{r['input_tokens']} tokens {r['hit_rate']:.0%}: "
            + ", ".join(f"{LABELS[c]} {r[f'short_hits_{c}']}" for c in configs)
            for r in rows
            if r["hit_rate"] and any(f"short_hits_{c}" in r for c in configs)
        ]
        if shorts:
            reps = len(rows[0][f"reps_{configs[0]}_s"])
            notes += (
                f"Probes (of {reps}) that found less than the prefix cached (the seed's saves "
                "still in flight): " + "; ".join(shorts) + ".\n\n"
            )
    if any(k.endswith("_inflight_cost_ms") for k in paired):
        notes += (
            "In flight: per rep, (probe - twin) of the configuration minus (probe - twin) of "
            "no connector, where the twin is a like miss timed on the same engine after the "
            "probe's saves drained: what the pool's work still in flight cost the probe, "
            "each engine its own baseline.\n\n"
        )
    cpu = [c for c in configs if f"cpu_{c}" in rows[-1]]
    if cpu:
        notes += _cpu_table(rows, cpu) + "\n\n"
    return table(header, out) + "\n\n" + notes + measured_at(results, names)


def _cpu_table(rows: Sequence[dict[str, Any]], configs: Sequence[str]) -> str:
    """A back-to-back run's CPU (``scripts/_cpu.py``): each configuration's CPU time per
    turn over no connector's, and that per GB kvray's pool moved."""
    header = ["input", "hit", "GB moved"]
    header += [f"{LABELS[c]} CPU ms over no connector" for c in configs]
    header += [f"{LABELS[c]} CPU s per GB" for c in configs]
    out = []
    for r in rows:
        row = [str(r["input_tokens"]), f"{r['hit_rate']:.0%}", f(r.get("moved_gb"), 3)]
        row += [f(r[f"cpu_{c}"]["extra_cpu_ms"], 0) for c in configs]
        row += [f(r[f"cpu_{c}"]["cpu_s_per_gb"], 2) for c in configs]
        out.append(row)
    return (
        "CPU time per turn (its requests, user + system of every process below the "
        "benchmark: the engines, Ray, the pool's actors, the masters), median over reps of "
        "each configuration's minus no connector's in the same rep; per GB: that over the "
        "bytes kvray's pool stored and loaded in the turn (the same prompts' bytes for "
        "every configuration).\n\n" + table(header, out)
    )


def _paired_label(key: str) -> str:
    if key == "checksum_cost":
        return "checksum cost, paired [95 % CI]"
    if key.endswith("_inflight_cost_ms"):
        return f"{key.removesuffix('_inflight_cost_ms')} in flight ms, paired [95 % CI]"
    words = key.removesuffix("_ms").replace("_minus_", " - ").replace("local", "ideal")
    return f"{words} ms, paired [95 % CI]"


def _paired_cell(key: str, d: dict[str, Any] | None) -> str:
    if key == "checksum_cost":
        return pct_ci(d)
    return ci(d)


def render_layerwise(results: Results, names: Sequence[str]) -> str:
    """bench_layerwise.py: layer-wise transfers against whole-step ones, per placement."""
    (name,) = names
    cols = ("local", "kvray", "kvray-lw", "staged", "staged-lw")
    rows = []
    for r in results(name)["rows"]:
        med = {c: r[c]["median_s"] * 1e3 for c in cols}
        rows.append(
            [str(r["input_tokens"]), f"{r['hit_rate']:.0%}"]
            + [f"{med[c]:.1f} {spread(r[c]['reps_s'])}" for c in cols]
            + [
                f"{(med['kvray-lw'] / med['kvray'] - 1) * 100:+.1f} %",
                f"{(med['staged-lw'] / med['staged'] - 1) * 100:+.1f} %",
            ]
        )
    header = [
        "input",
        "hit",
        "ideal ms",
        "kvray ms",
        "kvray layer-wise ms",
        "staged ms",
        "staged layer-wise ms",
        "layer-wise vs whole, shared",
        "layer-wise vs whole, staged",
    ]
    return table(header, rows) + "\n\n" + measured_at(results, names)


PARTS = (
    "to_lookup",
    "lookup",
    "async_load",
    "to_step",
    "load",
    "load_client",
    "load_rest",
    "forward",
    "after_step",
    "to_caller",
)


def render_breakdown(results: Results, names: Sequence[str]) -> str:
    """ttft_breakdown.py: kvray's TTFT split by its timeline, next to the ideal."""
    runs = [(n, results(n)) for n in names]
    parts = [p for p in PARTS if any(p in r["parts_ms"] for _, run in runs for r in run["rows"])]
    header = (
        (["result"] if len(runs) > 1 else [])
        + ["input", "hit", "ideal ms", "kvray ms", "excess ms"]
        + [p.replace("_", " ") for p in parts]
    )
    rows = []
    for n, run in runs:
        for r in run["rows"]:
            local, kv = r["local_ttft_ms"], r["kvray_ttft_ms"]
            row = ([f"`{n}`"] if len(runs) > 1 else []) + [
                str(r["input_tokens"]),
                f"{r['hit_rate']:.0%}",
                f(local),
                f(kv),
                f"{kv - local:+.1f}",
            ]
            row += [f(r["parts_ms"].get(p), 2) for p in parts]
            rows.append(row)
    return table(header, rows) + "\n\n" + measured_at(results, names)


def render_serve(results: Results, names: Sequence[str]) -> str:
    """bench_serve.py: ``vllm bench serve`` twice on the same prompts; run 2 is all prefix
    hits. Per-rep ratios of run 2's mean TTFT: kvray's (and ``async``'s, where it ran)
    against every other mode's."""
    (name,) = names
    run = results(name)
    rows = [
        [
            t["mode"],
            f(t["run1_mean_ttft_ms"]),
            f(t["run2_mean_ttft_ms"]),
            f(t["run2_p90_ttft_ms"]),
            f(t["run2_p99_ttft_ms"]),
            f"±{t['run2_spread']:.0%}",
            f"{t['run2_hits']}/{t['run2_blocks']}" if t["run2_blocks"] else "-",
            " / ".join(
                "-" if t.get(f"run{n}_cpu_s_per_gb") is None else f"{t[f'run{n}_cpu_s_per_gb']:.2f}"
                for n in (1, 2)
            ),
        ]
        for t in run["table"]
    ]
    header = [
        "mode",
        "run 1 mean TTFT ms",
        "run 2 mean TTFT ms",
        "run 2 P90 ms",
        "run 2 P99 ms",
        "run 2 spread",
        "run 2 blocks loaded from the pool",
        "CPU over none, s per GB moved (run 1 / run 2)",
    ]
    notes = []
    run2 = {(r["mode"], r["rep"]): r["mean_ttft_ms"] for r in run["runs"] if r["run"] == 2}
    modes = [t["mode"] for t in run["table"]]
    reps = sorted({rep for _, rep in run2})
    pairs = [(mine, other) for mine in ("kvray", "async") if mine in modes for other in modes]
    # (each mode against itself left out, and kvray / async: async / kvray is shown)
    pairs = [(a, b) for a, b in pairs if a != b and (a, b) != ("kvray", "async")]
    for mine, other in pairs:
        ratios = [run2[(mine, i)] / run2[(other, i)] for i in reps]
        below = sum(q <= 1 for q in ratios)
        notes.append(
            f"{mine} / {other}: median {statistics.median(ratios):.2f}x, "
            f"at or below 1 in {below} of {len(ratios)} reps"
        )
    if "checksum_cost" in run:
        notes.append(f"the checksum's cost (kvray / nock): {pct_ci(run['checksum_cost'])}")
    text = table(header, rows)
    if notes:
        text += "\n\nRun 2, per rep: " + "; ".join(notes) + "."
    parts = {
        t["mode"]: dict(t["run2_cpu_parts_ms"]) for t in run["table"] if "run2_cpu_parts_ms" in t
    }
    if parts:
        kinds = largest(parts, SERVE_CPU_KINDS)
        text += "\n\nRun 2's CPU by process, ms (median over reps):\n\n" + table(
            ["process", *parts],
            [[f"`{n}`", *(f"{p.get(n, 0.0):.0f}" for p in parts.values())] for n in kinds],
        )
    return text + "\n\n" + measured_at(results, names)


SERVE_CPU_KINDS = 6
"""Process kinds in bench_serve's CPU split table (the largest in any mode)."""


def _first_and_repeats(runs: list[dict[str, Any]]) -> tuple[float, float]:
    first: list[float] = []
    repeat: list[float] = []
    for r in runs:
        seen: set[int] = set()
        for prefix, ttft in zip(r["prefixes"], r["ttfts_ms"], strict=True):
            (repeat if prefix in seen else first).append(ttft)
            seen.add(prefix)
    return statistics.median(first), statistics.median(repeat)


def render_route(results: Results, names: Sequence[str]) -> str:
    """bench_route.py: kvray's proxy in front of 2 servers, 4 arms, per-rep ratios."""
    (name,) = names
    run = results(name)
    rows = []
    for t in run["table"]:
        first, repeats = _first_and_repeats([r for r in run["runs"] if r["arm"] == t["arm"]])
        rows.append(
            [
                t["arm"],
                f(t["p50_ms"]),
                f(t["p99_ms"]),
                ratio_ci(t["p50_vs_local_rr"]),
                ratio_ci(t["p50_vs_pool_rr"]),
                f(first, 0),
                f(repeats, 0),
            ]
        )
    header = [
        "arm",
        "p50 TTFT ms",
        "p99 ms",
        "p50 / local-rr [95 % CI]",
        "p50 / pool-rr [95 % CI]",
        "first asking, median ms",
        "repeats, median ms",
    ]
    return table(header, rows) + "\n\n" + measured_at(results, names)


# --- soak ------------------------------------------------------------------------------


def render_soak(results: Results, names: Sequence[str]) -> str:
    """soak.py: the whole summary of one run."""
    (name,) = names
    s = results(name)
    m, req, ttft = s["meta"], s["requests"], s["ttft_s"]
    kinds = ", ".join(
        f"{k} {v['injected']}" + (f" ({v['not_shown']} not shown)" if v["not_shown"] else "")
        for k, v in s["faults_by_kind"].items()
    )
    shown = sum(f_["ok"] for f_ in s["faults"])
    after = ", ".join(f"{k} {v}" for k, v in s["recomputed_after"].items() if k[0] != "(")
    misses = ", ".join(
        f"{k} {int(v)}" for k, v in sorted(s["misses"].items(), key=lambda kv: -kv[1]) if v
    )
    left = s["left_behind"]
    left_txt = (
        f"{len(left['processes'])} processes, {len(left['shm_files'])} `/dev/shm` files, "
        f"{len(left['files'])} files; {left['driver_sockets']} driver sockets still open (listed)"
    )
    rows = [
        [
            "load",
            f"{s['load_s']:.0f} s (`--duration {m['duration']:.0f}`), {m['clients']} clients, "
            f"{m['prompts']} prompts over {m['prefixes']} prefixes, checksums {m['checksum']}",
        ],
        [
            "requests",
            f"{req['total']}: **{req['wrong']} with other tokens than the oracle, "
            f"{req['failed']} failed**, {req['slow']} over `--max-request-s`; "
            f"worst {req['worst_s']:.2f} s",
        ],
        ["faults", f"{len(s['faults'])}, {shown} shown to have taken effect: {kinds}"],
        [
            "pool blocks",
            f"{s['blocks']['hit']} hit at lookup, {s['blocks']['loaded']} loaded, "
            f"{s['blocks']['recomputed']} recomputed",
        ],
        ["recomputed, by the last fault before", after or "-"],
        ["misses by reason", misses or "none"],
        ["checksum failures", f"{s['corrupt']['dram']} in DRAM, {s['corrupt']['ssd']} SSD blocks"],
        [
            "TTFT",
            f"p50 {ttft['p50']:.3f} s, p90 {ttft['p90']:.3f} s, p99 {ttft['p99']:.3f} s, "
            f"worst {ttft['worst']:.3f} s",
        ],
        ["left behind", left_txt],
    ]
    return table(["", ""], rows) + "\n\n" + measured_at(results, names)


# --- the README ------------------------------------------------------------------------


def render_headline(results: Results, names: Sequence[str]) -> str:
    """The README's one table: a row per headline result, each with its commit."""
    ttft = next(r for r in results("bench_ttft.json")["rows"] if r["hit_rate"] >= 0.9)
    serve = results("bench_serve.json")
    run2 = {(r["mode"], r["rep"]): r["mean_ttft_ms"] for r in serve["runs"] if r["run"] == 2}
    reps = sorted({rep for _, rep in run2})

    def serve_ratio(other: str) -> float:
        return float(statistics.median(run2[("kvray", i)] / run2[(other, i)] for i in reps))

    store = results("bench_store.json")
    g, lk = store["gbps"], store["lookup_ms"]
    raw_get = max(g["raw"]["get"], g["raw x4"]["get"])
    channel = {r["call"]: r for r in results("bench_channel.json")["rows"]}
    soak = results("soak.json")
    route = {t["arm"]: t for t in results("bench_route.json")["table"]}

    def chat_ratio(
        other: str, key: str, arm: str = "kvray-pc", name: str = "bench_workloads_chat.json"
    ) -> float:
        runs = {(r["arm"], r["rep"]): r for r in results(name)["runs"]}
        reps = sorted({rep for _, rep in runs})
        return float(statistics.median(runs[(arm, i)][key] / runs[(other, i)][key] for i in reps))

    def chat_row(name: str, where: str) -> str:
        local = [chat_ratio("local", f"{q}_ttft_ms", name=name) for q in ("p50", "p90")]
        peer = [chat_ratio("peer", f"{q}_ttft_ms", name=name) for q in ("p50", "p90")]
        return (
            f"kvray below vLLM's prefix cache: p50 {local[0]:.2f}x, p90 {local[1]:.2f}x the "
            f"prefix cache alone; p50 {peer[0]:.2f}x, p90 {peer[1]:.2f}x "
            f"MooncakeStoreConnector{where}"
        )

    def commit(name: str) -> str:
        return str(meta(results(name))["commit"])

    rows = [
        [
            f"TTFT, {ttft['input_tokens']}-token prompt, {ttft['hit_rate']:.0%} of it in the pool",
            f"kvray {ttft['ttft_kvray_s'] * 1e3:.1f} ms, MooncakeStoreConnector "
            f"{ttft['ttft_peer_s'] * 1e3:.1f} ms, vLLM's own prefix cache "
            f"{ttft['ttft_local_s'] * 1e3:.1f} ms "
            f"(kvray - it, paired: {ci(ttft['kvray_minus_local_ms'])} ms)",
            "bench_ttft.json",
        ],
        [
            "`vllm bench serve` twice, run 2 all hits: mean TTFT",
            f"kvray {serve_ratio('peer'):.2f}x MooncakeStoreConnector, {serve_ratio('local'):.2f}x "
            "vLLM's own prefix cache (medians of per-rep ratios)",
            "bench_serve.json",
        ],
        [
            "multi-user chat, working set over three times the engine's cache, 4 in flight: TTFT",
            chat_row(
                "bench_workloads_chat.json",
                "; vLLM's prefix cache holding the whole working set: p50 "
                f"{chat_ratio('local', 'p50_ttft_ms', arm='ideal'):.2f}x the prefix cache alone "
                "(medians of per-rep ratios)",
            ),
            "bench_workloads_chat.json",
        ],
        [
            "the same chat, working set over six times the engine's cache, 2 in flight: TTFT",
            chat_row("bench_workloads_chat_cache40.json", " (medians of per-rep ratios)"),
            "bench_workloads_chat_cache40.json",
        ],
        [
            "store get, blocks in a shared region",
            f"{g['kvray']['get']:.2f} GB/s, {g['kvray']['get'] / raw_get:.2f}x "
            "Mooncake's raw client",
            "bench_store.json",
        ],
        [
            "lookup of 1000 blocks, as the scheduler sees it",
            f"p50 {lk['index_p50']:.2f} ms, p99 {lk['index_p99']:.2f} ms (a Lookup actor call: "
            f"{lk['p50']:.2f} ms p50)",
            "bench_store.json",
        ],
        [
            "a step's control message to the node's BackendClient",
            f"{channel['empty']['channel_ms']['p50']:.2f} ms p50 over the node channel, "
            f"{channel['empty']['ray_ms']['p50']:.2f} ms as a Ray call",
            "bench_channel.json",
        ],
        [
            "routing: p50 TTFT, prefix router + pool vs round-robin without it",
            f"{route['pool-router']['p50_vs_local_rr']['median']:.2f}x",
            "bench_route.json",
        ],
        [
            "soak under every fault kind",
            f"{soak['requests']['total']} requests in {soak['load_s']:.0f} s, "
            f"{len(soak['faults'])} faults: {soak['requests']['wrong']} wrong, "
            f"{soak['requests']['failed']} failed",
            "soak.json",
        ],
    ]
    out = [[what, value, f"`{name}` at {commit(name)}"] for what, value, name in rows]
    machine = meta(store)["machine"]
    return (
        table(["", "measured", "result, commit"], out)
        + f"\n\nAll on one machine: {machine}, CPU only."
    )


def render_workloads(results: Results, names: Sequence[str]) -> str:
    """bench_workloads.py: per case and arm, p50 / p90 TTFT, TPOT, end to end, the
    speedup over full compute and the p50 over vLLM's prefix cache and the peer (paired
    per rep); the chat's targets below."""
    (name,) = names
    run = results(name)
    rows = [
        [
            t["case"],
            t["arm"],
            f(t["p50_ttft_ms"]),
            f(t["p90_ttft_ms"]),
            f(t["mean_tpot_ms"]),
            f(t["mean_e2e_ms"]),
            "-" if t["speedup_over_none"] is None else f"{t['speedup_over_none']:.2f}x",
            "-" if t["p50_over_local"] is None else f"{t['p50_over_local']:.2f}x",
            "-" if t["p50_over_peer"] is None else f"{t['p50_over_peer']:.2f}x",
            f"{t['pool_hit_blocks']}/{t['total_blocks']}" if t["total_blocks"] else "-",
        ]
        for t in run["table"]
    ]
    header = [
        "case", "arm", "p50 TTFT ms", "p90 TTFT ms", "TPOT ms", "E2E ms",
        "TTFT speedup over none", "p50 / local", "p50 / peer", "blocks loaded from the pool",
    ]  # fmt: skip
    text = table(header, rows)
    targets, beside = [], []
    for key, t in run.get("targets", {}).items():
        if t["median"] is None:
            continue
        metric, base = key.split("_over_")
        arm = t.get("arm", "kvray-pc")
        metric = metric.removeprefix(f"{arm}_")
        what = f"{arm} {metric} TTFT / {base} {ratio_ci(t)}"
        if t["bound"] is None:
            beside.append(what)
        else:
            verdict = "met" if t["met"] else "not met"
            targets.append(f"{what} (bound {t['bound']:g}: {verdict})")
    if targets:
        text += "\n\nTargets, paired per rep: " + "; ".join(targets) + "."
    if beside:
        text += " Beside them: " + "; ".join(beside) + "."
    return text + "\n\n" + measured_at(results, names)


RENDERERS: dict[str, Callable[[Results, Sequence[str]], str]] = {
    "store": render_store,
    "lookup": render_lookup,
    "cross-node": render_cross_node,
    "store-checksum-hit": render_store_checksum_hit,
    "ssd": render_ssd,
    "channel": render_channel,
    "ttft": render_ttft,
    "layerwise": render_layerwise,
    "breakdown": render_breakdown,
    "serve": render_serve,
    "route": render_route,
    "workloads": render_workloads,
    "soak": render_soak,
    "headline": render_headline,
}
