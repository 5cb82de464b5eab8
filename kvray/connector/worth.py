"""Scheduler side: whether a pool hit is worth loading, decided from this engine's own
measured rates.

A hit of ``H`` blocks costs a load: a fixed overhead (a channel round trip, a step's
bookkeeping) plus a time per block, apart for DRAM and for blocks only the SSD tier
holds. Not taking it costs computing its ``H * block_size`` tokens: a time per token.
Both are straight lines fitted to what the engine already reports, so measuring costs no
call and no wait:

- a computing step's forward time against the tokens it scheduled (the worker's
  :class:`~kvray.connector.timeline.StepTimes`), steps of at least a block of tokens
  only (decode steps say little about a prefill's cost per token);
- a synchronous load's wait against the blocks that step loaded (the forward waited for
  exactly those), or an asynchronous load's own time against its blocks: the
  BackendClient's time serving it, as the worker reports it (over the node channel;
  over Ray calls none is reported, and such loads are no samples). Not the time its
  request waited: that holds the steps of other requests running meanwhile, which on a
  busy engine is longer than any load, and would refuse every hit.

Each line is a Theil-Sen fit (the median of the slopes between every two samples, then
the median intercept) over the last :data:`WINDOW` samples: a step slowed by a
neighbour's burst moves it no more than a sample. With linear costs on both sides, what
taking ``k`` of the ``H`` blocks saves, ``k * (per_token * block_size - per_block) -
overhead``, is monotonic in ``k``: the best prefix is all of the hit or none of it, so
the decision is all or nothing.

The same measurements decide where a step's further hits load under ``load_async: auto``
(:meth:`Worth.joins_step`). A step's forward is fitted to a plane: a fixed cost, a time
per token it computes, and a time per pair of tokens its attention relates (a request's
``q`` new tokens after ``c`` computed ones: ``q * (c + (q + 1) / 2)``), least squares over
the last :data:`WINDOW` computing steps less the ones far off it. So a hit with 32 tokens
left after 4000 is priced at what its attention over the 4000 costs, which the tokens
alone do not show. A hit loaded before the forward makes the step longer by its load and
its compute, for every request in the step; loaded beside it, its request computes in the
next step, once every load of the step has landed, together with the step's other hits
put beside it. The hit joins where the sum of those requests' waits (to the end of the
step each computes in) is no larger with it in the step than beside it: a burst of hits
splits into a first wave that computes at once and a second whose loads run during the
first's forward; a lone hit on an engine that is decoding loads beside the step.

Until a line has :data:`MIN_SAMPLES` samples at two or more sizes (no slope from one
size), a hit is taken, as without this module. A refused hit produces no load sample, so
a tier that got faster would never be seen: every :data:`PROBE_EVERY`-th hit refused in
a row on a tier is taken anyway, to measure it again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np

WINDOW = 32
"""Samples each line is fitted to (the newest)."""
MIN_SAMPLES = 8
"""Samples a line needs before it decides anything."""
PROBE_EVERY = 16
"""A tier's hits refused in a row before one is taken to measure the tier again."""
STEPS_KEPT = 64
"""Built steps whose times may still come back (older ones are dropped unmeasured)."""


class Line:
    """``y = a + b * x`` fitted robustly to the last :data:`WINDOW` samples."""

    def __init__(self) -> None:
        self._xy: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float] | None = None
        self._dirty = False

    def add(self, x: float, y: float) -> None:
        self._xy.append((x, y))
        self._dirty = True

    def __len__(self) -> int:
        return len(self._xy)

    def samples(self) -> list[tuple[float, float]]:
        return list(self._xy)

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``, neither below 0 (a cost), or None: too few samples, or all at one
        ``x`` (which cannot tell the overhead from the rate)."""
        if self._dirty:
            self._dirty = False
            self._fit = theil_sen(list(self._xy)) if len(self._xy) >= MIN_SAMPLES else None
        return self._fit


def theil_sen(xy: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """``(a, b)`` of ``y = a + b * x`` (neither below 0), or None: no two ``x`` differ."""
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(xy) for x2, y2 in xy[i + 1 :] if x2 != x1
    ]
    if not slopes:
        return None
    b = max(0.0, median(slopes))
    return max(0.0, median(y - b * x for x, y in xy)), b


def attention_pairs(tokens: int, context: int) -> float:
    """The token pairs a request's attention relates in a step: each of its ``tokens`` new
    tokens with every token before it and itself (``context`` computed before the step)."""
    return tokens * (context + (tokens + 1) / 2)


@dataclass(frozen=True)
class StepCosts:
    """A step's forward: ``overhead_ms + per_token_ms * tokens + per_pair_ms * pairs``."""

    overhead_ms: float
    per_token_ms: float
    per_pair_ms: float

    def request_ms(self, tokens: int, context: int) -> float:
        """What computing ``tokens`` more of a request after ``context`` adds to a step."""
        return self.per_token_ms * tokens + self.per_pair_ms * attention_pairs(tokens, context)


class Forwards:
    """Computing steps' forward ms against their tokens and attention pairs: the last
    :data:`WINDOW`, fitted by least squares, then again without the steps more than three
    (scaled) median absolute deviations off the fit (a step slowed by a neighbour). No rate
    is negative: where one comes out below 0, the plane without it (the better fitting of
    the two) is taken; None while too few steps, or steps that cannot tell the rates
    apart."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._fit: StepCosts | None = None
        self._dirty = False

    def add(self, tokens: int, pairs: float, ms: float) -> None:
        self._samples.append((float(tokens), pairs, ms))
        self._dirty = True

    def fit(self) -> StepCosts | None:
        if self._dirty:
            self._dirty = False
            self._fit = fit_forwards(list(self._samples))
        return self._fit


def fit_forwards(samples: Sequence[tuple[float, float, float]]) -> StepCosts | None:
    """See :class:`Forwards`."""
    if len(samples) < MIN_SAMPLES:
        return None
    data = np.asarray(samples, dtype=np.float64)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    y = data[:, 2]
    best: tuple[float, StepCosts] | None = None
    for cols in ((0, 1, 2), (0, 1), (0, 2)):
        fitted = _trimmed_lstsq(x[:, cols], y)
        if fitted is None:
            continue
        coef, err = fitted
        rates = dict(zip(cols, coef, strict=True))
        if min(rates.get(1, 0.0), rates.get(2, 0.0)) < 0:
            continue
        costs = StepCosts(
            max(0.0, float(rates[0])), float(rates.get(1, 0.0)), float(rates.get(2, 0.0))
        )
        if len(cols) == 3:
            return costs
        if best is None or err < best[0]:
            best = (err, costs)
    return None if best is None else best[1]


def _trimmed_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Least-squares coefficients of ``y ~ x`` and their median absolute residual, refitted
    without the samples far off the first fit; None where ``x`` cannot tell them apart."""
    scale = np.abs(x).max(axis=0)
    if (scale == 0).any():
        return None
    xs = x / scale
    if np.linalg.matrix_rank(xs) < x.shape[1]:
        return None
    coef = np.linalg.lstsq(xs, y, rcond=None)[0]
    resid = y - xs @ coef
    spread = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    keep = np.abs(resid - np.median(resid)) <= 3 * spread
    if spread > 0 and MIN_SAMPLES <= keep.sum() < len(y):
        if np.linalg.matrix_rank(xs[keep]) < x.shape[1]:
            return None
        coef = np.linalg.lstsq(xs[keep], y[keep], rcond=None)[0]
        resid = y - xs @ coef
    return coef / scale, float(np.median(np.abs(resid)))


@dataclass
class StepSoFar:
    """What the step being scheduled holds so far, as ``load_async: auto`` weighs its
    further hits."""

    requests: int = 0
    """Requests it computes: those the last step ran (as near as the connector sees
    them) and those admitted to compute in it since."""
    loads: int = 0
    """Hits loading before its forward."""
    added_ms: float = 0.0
    """What those hits add to its forward (their loads and compute, as estimated)."""
    beside: int = 0
    """Hits admitted in it that load beside its forward (their requests compute later)."""


@dataclass(frozen=True)
class Estimate:
    """A hit's measured costs: loading its blocks, and computing their tokens instead."""

    load_ms: float
    compute_ms: float


@dataclass(frozen=True)
class Decision:
    """Load a hit, or compute it, and the estimate that decided (None: a side not
    measured yet, so loaded)."""

    load: bool
    """(True also for the tier's :data:`PROBE_EVERY`-th refusal in a row: measured
    slower, loaded to measure the tier again.)"""
    estimate: Estimate | None


@dataclass
class _Loading:
    """Blocks planned for a load: from DRAM, and those only the SSD tier held."""

    dram: int = 0
    ssd: int = 0
    served_ms: float | None = None
    """An async load's own time, as the ranks report it (the slowest rank's)."""


class Worth:
    """One engine instance's load and compute rates, and the decision they make."""

    def __init__(self) -> None:
        self.compute = Line()
        """Forward ms against the tokens a step scheduled."""
        self.dram = Line()
        """Load ms against the blocks loaded, loads from DRAM only."""
        self._ssd: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        """Loads with SSD blocks: (DRAM blocks, SSD blocks, ms), fitted once the DRAM
        line can take the DRAM blocks' share out."""
        self._refused = {"dram": 0, "ssd": 0}
        self._sync = _Loading()
        self._async: dict[str, _Loading] = {}
        self._async_unsent: dict[str, _Loading] = {}
        self._steps: dict[int, tuple[int, float, _Loading]] = {}
        """Built step -> (tokens it scheduled, their attention pairs, its sync loads),
        until its times come."""
        self.forwards = Forwards()
        """Forward ms against the tokens and attention pairs of the steps that computed."""

    # ---- the decision --------------------------------------------------------------------

    def estimate(self, blocks: int, ssd: int, block_size: int) -> Estimate | None:
        """What loading a hit of ``blocks`` blocks (``ssd`` of them only on the SSD tier)
        and computing its tokens are measured to cost, or None while either side is not
        measured."""
        compute = self.compute.fit()
        load_ms = self.load_ms(blocks - ssd, ssd)
        if compute is None or load_ms is None or compute[1] <= 0:
            return None
        return Estimate(load_ms, compute[1] * blocks * block_size)

    def decide(self, blocks: int, ssd: int, block_size: int) -> Decision:
        """Whether to load a hit of ``blocks`` blocks (``ssd`` of them only on the SSD
        tier) rather than compute their tokens (loaded while either side is not
        measured), with the estimate it was decided from."""
        tier = "ssd" if ssd else "dram"
        estimate = self.estimate(blocks, ssd, block_size)
        if estimate is None:
            return Decision(True, None)
        if estimate.load_ms <= estimate.compute_ms:
            self._refused[tier] = 0
            return Decision(True, estimate)
        self._refused[tier] += 1
        if self._refused[tier] >= PROBE_EVERY:
            self._refused[tier] = 0
            return Decision(True, estimate)
        return Decision(False, estimate)

    def hit_ms(self, dram: int, ssd: int, tokens: int, context: int) -> tuple[float, float] | None:
        """What a hit of ``dram`` + ``ssd`` blocks, with ``tokens`` left to compute after
        ``context``, adds to a step's forward it joins: ``(its load, its compute)``, or None
        while a rate is not measured."""
        load = self.load_ms(dram, ssd)
        if load is None and not ssd and len(self.dram) >= 2:
            # No line yet (hits all of one size, as a burst's often are): the samples' time
            # per block, overhead included, which overestimates a smaller hit's load.
            load = dram * median(ms / x for x, ms in self.dram.samples() if x)
        costs = self.forwards.fit()
        if load is None or costs is None:
            return None
        return load, costs.request_ms(tokens, context)

    def joins_step(
        self, hit: tuple[float, float] | None, step: StepSoFar, coming: int
    ) -> bool | None:
        """Whether a step's further hit (``load_async: auto``) that adds ``hit`` to a
        forward (:meth:`hit_ms`) loads before the step's forward, the step holding ``step``
        so far and ``coming`` more hits to weigh: the sum of the waits of the step's
        requests and of its hits outside it, each to the end of the step it computes in,
        is no larger with this hit in the step than beside it (see the module). None: a
        rate is not measured yet."""
        costs = self.forwards.fit()
        if hit is None or costs is None:
            return None
        load, compute = hit

        def waits(inside: int, loads: int, added_ms: float, outside: int) -> float:
            base = costs.overhead_ms + costs.per_token_ms * inside
            forward = base + added_ms
            landed = (loads + outside) * load  # every load of the step, on one loader
            return inside * forward + outside * (max(forward, landed) + base + outside * compute)

        outside = step.beside + 1 + coming
        with_it = waits(step.requests + 1, step.loads + 1, step.added_ms + load + compute,
                        outside - 1)  # fmt: skip
        return with_it <= waits(step.requests, step.loads, step.added_ms, outside)

    def load_ms(self, dram: int, ssd: int) -> float | None:
        """The estimated time to load ``dram`` + ``ssd`` blocks (None: not measured)."""
        line = self.dram.fit()
        if not ssd:
            return None if line is None else line[0] + line[1] * dram
        ssd_line = self._ssd_line(line)
        if ssd_line is None or (dram and line is None):
            return None
        return ssd_line[0] + ssd_line[1] * ssd + (line[1] * dram if line else 0.0)

    def _ssd_line(self, dram: tuple[float, float] | None) -> tuple[float, float] | None:
        """SSD loads' overhead and time per SSD block: each sample less its DRAM blocks'
        time at the DRAM rate (samples with DRAM blocks wait for that rate)."""
        xy = [(s, ms - (dram[1] * d if dram else 0.0)) for d, s, ms in self._ssd if dram or not d]
        return theil_sen(xy) if len(xy) >= MIN_SAMPLES else None

    # ---- what is measured ----------------------------------------------------------------

    def planned(self, rid: str, blocks: int, ssd: int, *, load_async: bool) -> None:
        """A request's load of ``blocks`` blocks was planned for the next step."""
        loading = _Loading(blocks - ssd, ssd)
        if load_async:
            self._async_unsent[rid] = loading
        else:
            self._sync.dram += loading.dram
            self._sync.ssd += loading.ssd

    def step_built(self, step: int, tokens: int, pairs: float = 0.0) -> None:
        """Step ``step`` was handed to the workers: ``tokens`` to compute, their attention
        ``pairs`` (:func:`attention_pairs`, summed), and the loads planned since the last
        step."""
        self._async.update(self._async_unsent)
        self._async_unsent.clear()
        self._steps[step] = (tokens, pairs, self._sync)
        self._sync = _Loading()
        self._steps.pop(step - STEPS_KEPT, None)

    def step_done(
        self, step: int, forward_ms: float, load_wait_ms: float, block_size: int, failed: bool
    ) -> None:
        """Step ``step``'s times are back; ``failed``: some load in it failed (its wait
        measured no load)."""
        built = self._steps.pop(step, None)
        if built is None:
            return
        tokens, pairs, loads = built
        if tokens:
            self.forwards.add(tokens, pairs, forward_ms)
        if tokens >= block_size:
            self.compute.add(tokens, forward_ms)
        if (loads.dram or loads.ssd) and not failed:
            self._add_load(loads, load_wait_ms)

    def async_served(self, served_ms: Mapping[str, float]) -> None:
        """A rank reports the async loads it ended, with each one's own time (the ranks
        may end a request's load in different steps: the slowest counts)."""
        for rid, ms in served_ms.items():
            loading = self._async.get(rid)
            if loading is not None:
                loading.served_ms = max(ms, loading.served_ms or 0.0)

    def async_done(self, rids: set[str], failed: set[str]) -> None:
        """Async loads ended on every rank (``failed``: those of them that failed: not
        samples; nor are those whose own time no rank reported)."""
        for rid in rids:
            loading = self._async.pop(rid, None)
            if loading is not None and loading.served_ms is not None and rid not in failed:
                self._add_load(loading, loading.served_ms)

    def forget(self, rid: str) -> None:
        self._async.pop(rid, None)
        self._async_unsent.pop(rid, None)

    def _add_load(self, loads: _Loading, ms: float) -> None:
        if loads.ssd:
            self._ssd.append((loads.dram, loads.ssd, ms))
        else:
            self.dram.add(loads.dram, ms)
