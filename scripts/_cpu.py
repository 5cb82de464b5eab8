"""CPU time of a benchmark's processes: what a configuration costs the machine's cores,
beside what it costs a request's latency.

Every process below the benchmark's own (the engines, Ray's GCS, raylet and workers, so
the pool's actors, and the Mooncake masters) is counted: user plus system time from
/proc, read around each turn. Engines not in turn are paused, so a turn's CPU is its
engine's and whatever the pool and Ray did meanwhile (the pool's background work, the
previous turn's saves finishing). A configuration's cost is its turn's CPU minus the
no-connector configuration's for the same prompts in the same rep, per GB the pool moved
(stored and loaded) in that turn. A back-to-back turn's CPU is also split by process
kind and by thread (:class:`PartsMeter`: the scheduler's nanosecond run times of each
live thread), to show which of the pool's processes took it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user + system seconds) of ``pid``; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S


def part_of(pid: int) -> str:
    """What a process is, for the CPU breakdown: a Ray worker by its title (``ray::``
    and its actor class: ``ray::BackendClient``), vLLM's by theirs (``VLLM::EngineCore``),
    anything else by its command name (``raylet``, ``gcs_server``, ``mooncake_master``)."""
    try:
        argv0 = (
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        )
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    title = argv0.split()[0] if argv0.split() else ""
    if title.startswith(("ray::", "VLLM::")):
        return title.split(".", 1)[0]
    return comm


class CpuMeter:
    """The CPU seconds used so far by every live process below ``root`` (this process)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root

    def total_s(self) -> float:
        return sum(self.by_pid().values())

    def by_pid(self) -> dict[int, float]:
        """CPU seconds so far of each live process below ``root``."""
        stats: dict[int, tuple[int, float]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and (st := _stat(name)) is not None:
                stats[int(name)] = st
        below: set[int] = {self.root}
        grew = True
        while grew:  # (a process tree a few levels deep: engines, raylet's workers)
            grew = False
            for pid, (ppid, _) in stats.items():
                if ppid in below and pid not in below:
                    below.add(pid)
                    grew = True
        return {pid: cpu for pid, (_, cpu) in stats.items() if pid in below and pid != self.root}


THREAD_MIN_S = 0.0005
"""A thread that ran less than this in a window is not listed in its split."""


class PartsMeter(CpuMeter):
    """A :class:`CpuMeter` that also splits a window's CPU by process (:func:`part_of`)
    and by thread within it, from each thread's scheduler run time (``schedstat``:
    nanoseconds, not the 10 ms ticks of ``stat``; a thread that ends within the window
    takes its time with it)."""

    def __init__(self, root: int | None = None) -> None:
        super().__init__(root)
        self._parts: dict[int, str] = {}

    def snapshot(self) -> dict[tuple[int, int], float]:
        """Run seconds so far of every thread of every process below ``root``."""
        out: dict[tuple[int, int], float] = {}
        for pid in self.by_pid():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    ns = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]
                except OSError:
                    continue
                out[(pid, int(tid))] = int(ns) / 1e9
        return out

    def parts_since(
        self, before: dict[tuple[int, int], float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """CPU seconds from ``before`` (a :meth:`snapshot`) to now: per process kind, and
        per ``kind/thread name``."""
        parts: dict[str, float] = {}
        threads: dict[str, float] = {}
        for (pid, tid), cpu in self.snapshot().items():
            part = self._parts.get(pid)
            if part is None or part == "ray::IDLE":
                part = self._parts[pid] = part_of(pid)
            used = cpu - before.get((pid, tid), 0.0)
            if used <= 0:
                continue
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                name = "gone"
            parts[part] = parts.get(part, 0.0) + used
            key = f"{part}/{name}"
            threads[key] = threads.get(key, 0.0) + used
        # (threads that ran under THREAD_MIN_S in the window are left out of the split)
        return parts, {k: round(v, 6) for k, v in threads.items() if v >= THREAD_MIN_S}


def cpu_per_gb(
    cpu_s: Sequence[float], full_s: Sequence[float], moved_bytes: Sequence[float]
) -> dict[str, Any]:
    """A configuration's CPU over no connector, per rep (``cpu_s`` and ``full_s`` paired),
    and per GB moved (``moved_bytes`` of the same reps): medians and every rep."""
    extra = [a - b for a, b in zip(cpu_s, full_s, strict=True)]
    per_gb = [e / (m / 1e9) for e, m in zip(extra, moved_bytes, strict=True) if m > 0]
    return {
        "extra_cpu_ms": statistics.median(extra) * 1e3,
        "reps_extra_cpu_ms": [e * 1e3 for e in extra],
        "cpu_s_per_gb": statistics.median(per_gb) if per_gb else None,
        "reps_cpu_s_per_gb": per_gb,
    }


def cpu_rows(
    row: dict[str, Any],
    reps: dict[tuple[str, int, float], list[float]],
    splits: dict[tuple[str, int, float], list[dict[str, float]]],
    configs: Sequence[str],
    length: int,
    rate: float,
) -> None:
    """A back-to-back row's CPU: every configuration's per rep (``reps_cpu_<c>_s``) and,
    for each but no connector, its cost over it per GB kvray's pool moved in the same rep
    (``cpu_<c>``; ``moved_gb`` the median bytes moved), and its split by process kind and
    by thread: per rep by process kind (``reps_cpu_parts_<c>``), and the median over reps
    by thread (``cpu_threads_ms_<c>``, milliseconds; a thread absent from a rep counts 0)."""
    for c in configs:
        row[f"reps_cpu_{c}_s"] = reps[(f"cpu_{c}", length, rate)]
        row[f"reps_cpu_parts_{c}"] = splits[(f"cpu_parts_{c}", length, rate)]
        row[f"cpu_threads_ms_{c}"] = split_medians(splits[(f"cpu_threads_{c}", length, rate)])
    moved = [
        g + p
        for g, p in zip(
            reps.get(("get_kvray", length, rate), []),
            reps.get(("put_kvray", length, rate), []),
            strict=True,
        )
    ]
    if not moved:
        return
    row["moved_gb"] = statistics.median(moved) / 1e9
    for c in configs:
        if c != "full":
            row[f"cpu_{c}"] = cpu_per_gb(row[f"reps_cpu_{c}_s"], row["reps_cpu_full_s"], moved)


def print_cpu(rows: list[dict[str, Any]], configs: Sequence[str]) -> None:
    """The CPU table of a back-to-back run."""
    names = [c for c in configs if any(f"cpu_{c}" in r for r in rows)]
    if not names:
        return
    print(
        f"\n{'input':>6} {'hit':>5} "
        + " ".join(f"{c + ' +cpu ms':>16} {c + ' s/GB':>12}" for c in names)
        + f" {'GB moved':>9}"
    )
    for r in rows:
        cells = []
        for c in names:
            got = r.get(f"cpu_{c}")
            if got is None:
                cells.append(f"{'-':>16} {'-':>12}")
                continue
            per = got["cpu_s_per_gb"]
            cells.append(f"{got['extra_cpu_ms']:16.1f} {'-' if per is None else f'{per:.2f}':>12}")
        print(
            f"{r['input_tokens']:>6} {r['hit_rate']:>5.0%} "
            + " ".join(cells)
            + f" {r.get('moved_gb', 0.0):9.3f}"
        )
    print(
        "+cpu ms = median over reps of the turn's CPU time (user + system, every process "
        "below the benchmark: engines, Ray, the pool's actors, the masters) minus no "
        "connector's in the same rep; s/GB = that over the GB kvray's pool stored and loaded "
        "in the turn (the same prompts' bytes for every configuration)"
    )


def split_medians(reps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per name, the median over reps of its seconds (absent from a rep: 0), in ms."""
    names = {n for rep in reps for n in rep}
    return {n: round(statistics.median(rep.get(n, 0.0) for rep in reps) * 1e3, 3) for n in names}


def largest(medians: dict[str, dict[str, float]], top: int) -> list[str]:
    """The ``top`` names (process kinds, threads) with the largest value in any of
    ``medians``' maps (per configuration or mode), the largest first."""
    most: dict[str, float] = {}
    for m in medians.values():
        for n, v in m.items():
            most[n] = max(most.get(n, v), v)
    return sorted(most, key=lambda n: -most[n])[:top]


def print_cpu_parts(
    rows: list[dict[str, Any]], configs: Sequence[str], top: int = 8, by: str = "parts"
) -> None:
    """Where each configuration's turn CPU went: the median over reps of each process
    kind's (``by="threads"``: each thread name's) CPU milliseconds (absent from a rep:
    0), the largest first."""
    for r in rows:
        medians: dict[str, dict[str, float]] = {}
        for c in configs:
            if by == "threads":
                medians[c] = r.get(f"cpu_threads_ms_{c}") or {}
            else:
                medians[c] = split_medians(r.get(f"reps_cpu_parts_{c}") or [])
        kinds = largest(medians, top)
        what = "process" if by == "parts" else "thread"
        print(f"\nCPU ms per turn by {what}, input {r['input_tokens']} hit {r['hit_rate']:.0%} "
              "(median over reps)")  # fmt: skip
        print(f"{what:>40} " + " ".join(f"{c:>9}" for c in configs))
        for n in kinds:
            print(f"{n[:40]:>40} " + " ".join(f"{medians[c].get(n, 0.0):9.1f}" for c in configs))
