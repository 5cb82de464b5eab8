"""Paired comparisons for the benchmarks: the median of per-rep ratios, with a bootstrap
confidence interval (reps are interleaved, so rep ``i`` of two configurations ran under
the same load: their ratio cancels what the machine did then)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np


def paired_ratio(
    num: Sequence[float], den: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """Median of ``num[i] / den[i]`` and its 95 % bootstrap interval (percentile method,
    resampling the pairs): ``{"median", "ci95", "ratios", "pairs"}``."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired_ratio needs equal, non-empty rep lists ({len(num)}, {len(den)})")
    ratios = np.asarray(num, dtype=float) / np.asarray(den, dtype=float)
    return {**_median_ci(ratios, resamples, seed), "ratios": [float(r) for r in ratios]}


def _median_ci(values: np.ndarray, resamples: int, seed: int) -> dict[str, Any]:
    """The median of ``values`` and its 95 % bootstrap interval (percentile method)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    lo, hi = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return {
        "median": float(statistics.median(values.tolist())),
        "ci95": [float(lo), float(hi)],
        "pairs": len(values),
    }


def paired_difference_ms(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """Median of ``a[i] - b[i]`` (seconds in, milliseconds out) and its 95 % bootstrap
    interval: ``{"median", "ci95", "diffs", "pairs"}``."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"paired_difference_ms needs equal, non-empty rep lists ({len(a)}, {len(b)})"
        )
    diffs = (np.asarray(a, dtype=float) - np.asarray(b, dtype=float)) * 1e3
    return {**_median_ci(diffs, resamples, seed), "diffs": [float(d) for d in diffs]}


def pct(ratio: float) -> str:
    """A ratio as a signed percentage change: 1.013 -> '+1.3%'."""
    return f"{(ratio - 1) * 100:+.1f}%"
