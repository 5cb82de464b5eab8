"""What the renderers of scripts/report.py share: the results they read, and how
numbers, tables and paired comparisons are written."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Results:
    """The JSON results, each read once; remembers which ones a render used."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.used: set[str] = set()
        self._cache: dict[str, Any] = {}

    def __call__(self, name: str) -> Any:
        if name not in self._cache:
            path = self.folder / name
            if not path.is_file():
                raise ReportError(f"bench-results/{name} does not exist")
            self._cache[name] = json.loads(path.read_text())
        self.used.add(name)
        return self._cache[name]


class ReportError(Exception):
    """A block that cannot be rendered: an unknown renderer, a missing result."""


def meta(data: dict[str, Any]) -> dict[str, Any]:
    """A result's meta: under ``meta``, or (older scripts) at its top level."""
    return data.get("meta", data)  # type: ignore[no-any-return]


def measured_at(results: Results, names: Sequence[str]) -> str:
    """The block's last line: each result's file, commit, machine and reps."""
    parts = []
    for name in names:
        m = meta(results(name))
        reps = f", {m['reps']} reps" if "reps" in m else ""
        parts.append(f"`{name}` at commit {m['commit']} ({m['machine']}{reps})")
    return "Measured: " + "; ".join(parts) + "."


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def spread(reps: Sequence[float]) -> str:
    """Half the range of the reps, relative to their median."""
    med = statistics.median(reps)
    return f"±{(max(reps) - min(reps)) / 2 / med * 100:.0f}%" if med else ""


def ci(d: dict[str, Any] | None, digits: int = 1) -> str:
    """A paired comparison: ``+9.0 [+5.0, +10.8]``."""
    if not d:
        return "-"
    lo, hi = d["ci95"]
    return f"{d['median']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def pct_ci(d: dict[str, Any] | None) -> str:
    """A paired ratio as a change in percent: ``+12.9 % [+3.3, +21.3]``."""
    if not d:
        return "-"
    lo, hi = ((v - 1) * 100 for v in d["ci95"])
    return f"{(d['median'] - 1) * 100:+.1f} % [{lo:+.1f}, {hi:+.1f}]"


def ratio_ci(d: dict[str, Any] | None) -> str:
    if not d:
        return "-"
    lo, hi = d["ci95"]
    return f"{d['median']:.2f}x [{lo:.2f}, {hi:.2f}]"
