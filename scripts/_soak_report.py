"""What a soak run reports (scripts/soak.py): the pool's blocks and counters attributed
to the fault before them, percentiles, what the run left behind, and the printed report."""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
from typing import Any

Row = dict[str, Any]
"""One request, or one fault, as the JSON keeps it."""


def per_window(faults: list[Row], at: list[int], end: int) -> dict[str, int]:
    """How much a counter grew between each fault and the next, summed per fault kind
    (before the first fault: ``(no fault yet)``)."""
    out = {"(no fault yet)": at[0] if at else end}
    marks = [*at, end]
    for i, fault in enumerate(faults):
        out[fault["kind"]] = out.get(fault["kind"], 0) + marks[i + 1] - marks[i]
    return out


def open_descriptors() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """``n``, p50, p90, p99 and the worst of ``values`` (None without any)."""
    v = sorted(values)

    def at(q: float) -> float | None:
        return round(v[min(len(v) - 1, int(q * len(v)))], 4) if v else None

    p50 = round(statistics.median(v), 4) if v else None
    return {"n": len(v), "p50": p50, "p90": at(0.9), "p99": at(0.99), "worst": at(1.0)}


def blocks_by_fault(
    results: list[Row], faults: list[Row], lines: dict[str, dict[str, int]], kinds: list[str]
) -> tuple[dict[str, int], dict[str, int]]:
    """The pool's blocks of the completed requests (``hit``, ``loaded``, ``recomputed``,
    from the connector's line of each), and the recomputed ones by the fault kind before
    each request ended (``(no fault yet)`` before the first)."""
    # The engine's request id is the response's id plus a suffix: a prefix lookup in the
    # sorted ids (one bisect per request, not a scan of every line).
    ids = sorted(lines)
    recomputed: dict[str, int] = {k: 0 for k in ["(no fault yet)", *kinds]}
    hit = loaded = failed = 0
    for r in results:
        rid = r.get("id") or ""
        at = bisect.bisect_left(ids, rid) if rid else len(ids)
        line = lines[ids[at]] if at < len(ids) and ids[at].startswith(rid) else None
        if line is None:
            continue
        hit += line.get("hit_pool", 0)
        loaded += line.get("loaded", 0)
        failed += line.get("failed", 0)
        end = r["start_s"] + r["total_s"]
        before = [f["kind"] for f in faults if f["at_s"] <= end]
        recomputed[before[-1] if before else "(no fault yet)"] += line.get("failed", 0)
    return {"hit": hit, "loaded": loaded, "recomputed": failed}, recomputed


def print_report(s: Row) -> None:
    m, req, ttft = s["meta"], s["requests"], s["ttft_s"]
    print()
    print(
        f"soak: {s['load_s']:.0f} s of load, {m['clients']} clients, {m['prompts']} prompts, "
        f"a fault every ~{m['fault_every']:g} s, checksum {m['checksum']}"
    )
    print(
        f"  requests            {req['total']} ({req['wrong']} wrong, {req['failed']} failed, "
        f"{req['slow']} over {m['max_request_s']:g} s)"
    )
    b = s["blocks"]
    print(
        f"  pool blocks         {b['hit']} hit at lookup, {b['loaded']} loaded, "
        f"{b['recomputed']} recomputed"
    )
    print(
        "  faults              "
        + ", ".join(
            f"{k} x{n['injected']}" + (f" ({n['not_shown']} NOT SHOWN)" if n["not_shown"] else "")
            for k, n in s["faults_by_kind"].items()
        )
    )
    for f in s["faults"]:
        shown = f["what"] if f["ok"] else f"NOT SHOWN: {f['error']}"
        print(f"    {f['at_s']:7.1f} s {f['kind']:<13} {shown}")
    print(
        "  recomputed after    " + ", ".join(f"{k} {n}" for k, n in s["recomputed_after"].items())
    )
    print(
        "  misses by reason    "
        + (", ".join(f"{k} {int(v)}" for k, v in s["misses"].items() if v) or "none")
    )
    if ttft["n"]:
        print(
            f"  TTFT s              p50 {ttft['p50']:.3f}  p90 {ttft['p90']:.3f}  "
            f"p99 {ttft['p99']:.3f}  worst {ttft['worst']:.3f}"
        )
    print(f"  worst request s     {req['worst_s']:.3f}")
    c = s["corrupt"]
    print(f"  corrupt blocks      {c['dram']} (DRAM checksums), {c['ssd']} (SSD)")
    print("  DRAM corrupt after  " + ", ".join(f"{k} {n}" for k, n in c["dram_after"].items()))
    left = s["left_behind"]
    print(
        f"  left behind         processes {len(left['processes'])}, /dev/shm files "
        f"{len(left['shm_files'])}, files {len(left['files'])} (driver sockets still open: "
        f"{left['driver_sockets']}; {left['fds_before']} fds before, "
        f"{left['fds_after']} after)"
    )
    fails = s["failures"]
    print("  result              " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)))
