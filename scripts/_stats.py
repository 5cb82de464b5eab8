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
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(resamples, len(ratios)))
    medians = np.median(ratios[picks], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return {
        "median": float(statistics.median(ratios.tolist())),
        "ci95": [float(lo), float(hi)],
        "ratios": [float(r) for r in ratios],
        "pairs": len(ratios),
    }


def pct(ratio: float) -> str:
    """A ratio as a signed percentage change: 1.013 -> '+1.3%'."""
    return f"{(ratio - 1) * 100:+.1f}%"
