"""The rates a hit's load is judged by: robust straight lines, none from one sample or one
size, and a refused tier measured again now and then."""

from __future__ import annotations

import pytest

from kvray.connector.worth import (
    MIN_SAMPLES,
    PROBE_EVERY,
    STEPS_KEPT,
    Line,
    StepSoFar,
    Worth,
    attention_pairs,
    fit_forwards,
)

BS = 16


def test_a_line_is_not_moved_by_an_outlier():
    line = Line()
    for x in range(1, MIN_SAMPLES + 1):
        line.add(x, 2.0 + 0.5 * x)
    line.add(3, 500.0)  # a step slowed by something else
    assert line.fit() == (2.0, 0.5)


def test_a_line_needs_enough_samples_at_two_sizes():
    line = Line()
    line.add(4, 3.0)
    line.add(8, 5.0)
    assert line.fit() is None  # two samples: not enough
    for _ in range(MIN_SAMPLES - 2):
        line.add(4, 3.0)
    assert line.fit() == (1.0, 0.5)
    one_size = Line()
    for _ in range(MIN_SAMPLES):
        one_size.add(4, 3.0)
    assert one_size.fit() is None  # no overhead apart from the rate


def slow_loads(w: Worth) -> None:
    """Loads of 2 ms + 0.05 ms a block; prefills of 0.01 ms a token (0.16 ms a block)."""
    for step in range(1, 2 * MIN_SAMPLES + 1):
        blocks = 1 + step % 4
        w.planned(f"r{step}", blocks, 0, load_async=False)
        w.step_built(step, 64 * step)
        w.step_done(step, 0.01 * 64 * step, 2.0 + 0.05 * blocks, BS, failed=False)


def test_a_tier_refused_in_a_row_is_measured_again():
    w = Worth()
    slow_loads(w)
    assert [w.decide(4, 0, BS).load for _ in range(PROBE_EVERY)] == [False] * (PROBE_EVERY - 1) + [
        True
    ]
    assert not w.decide(4, 0, BS).load


def test_a_step_whose_loads_failed_is_no_load_sample():
    w = Worth()
    for step in range(1, MIN_SAMPLES + 1):
        w.planned(f"r{step}", 1 + step % 4, 0, load_async=False)
        w.step_built(step, 0)
        w.step_done(step, 0.0, 50.0, BS, failed=True)
    assert len(w.dram) == 0


def test_steps_whose_times_never_came_are_forgotten():
    w = Worth()
    for step in range(1, 3 * STEPS_KEPT):
        w.step_built(step, 64)
    assert len(w._steps) == STEPS_KEPT


def plane_steps(w: Worth, overhead: float, per_token: float, per_pair: float) -> None:
    """Computing steps (no loads) on the plane ``overhead + per_token * tokens + per_pair *
    pairs``: prefills of 1 to 8 blocks, bursts of hits with 6 tokens left after 4 blocks,
    and decodes, as the workers report their forwards."""
    shapes = [[(BS * k, 0)] for k in range(1, 9)]
    shapes += [[(6, 4 * BS)] * k for k in range(1, 9)]
    shapes += [[(1, 8 * BS + k)] * k for k in range(1, 9)]
    for step, shape in enumerate(shapes, start=1000):
        tokens = sum(q for q, _ in shape)
        pairs = sum(attention_pairs(q, c) for q, c in shape)
        w.step_built(step, tokens, pairs)
        w.step_done(step, overhead + per_token * tokens + per_pair * pairs, 0.0, BS, False)


def test_forwards_are_fitted_to_tokens_and_attention_pairs_past_an_outlier():
    w = Worth()
    assert w.forwards.fit() is None  # nothing measured
    plane_steps(w, 1.0, 0.01, 0.002)
    w.step_built(1, 6 * 3, 3 * attention_pairs(6, 64))
    w.step_done(1, 500.0, 0.0, BS, False)  # a step slowed by something else
    costs = w.forwards.fit()
    assert costs is not None
    assert (costs.overhead_ms, costs.per_token_ms, costs.per_pair_ms) == (
        pytest.approx(1.0),
        pytest.approx(0.01),
        pytest.approx(0.002),
    )
    # a hit with 6 tokens left after 64 adds its tokens and its attention over the 64
    assert costs.request_ms(6, 64) == pytest.approx(0.06 + 0.002 * 6 * (64 + 3.5))


def test_forwards_that_cannot_tell_a_rate_apart_keep_the_other():
    """Prefills alone (no context) still fit both rates (their pairs grow as the square of
    their tokens); steps of one size fit none; a negative rate is dropped, not kept."""
    one_size = fit_forwards([(64.0, attention_pairs(64, 0), 3.0)] * MIN_SAMPLES)
    assert one_size is None
    no_attention = fit_forwards(
        [(float(t), attention_pairs(t, 0), 1.0 + 0.01 * t) for t in range(16, 16 * 9, 16)]
    )
    assert no_attention is not None
    assert (no_attention.overhead_ms, no_attention.per_token_ms) == (
        pytest.approx(1.0),
        pytest.approx(0.01),
    )
    assert no_attention.per_pair_ms == pytest.approx(0.0, abs=1e-12)
    falling = [(float(t), attention_pairs(t, 0), 2.0 + 0.02 * t - 1e-5 * attention_pairs(t, 0))
               for t in range(16, 16 * 9, 16)]  # fmt: skip
    costs = fit_forwards(falling)
    assert costs is not None and costs.per_pair_ms == 0.0 and costs.per_token_ms > 0
    assert fit_forwards(falling[: MIN_SAMPLES - 1]) is None  # too few steps


def hits_of(w: Worth, n: int, running: int) -> list[bool | None]:
    """Where a step's ``n`` further hits of 4 blocks with 6 tokens left load (True: before
    the forward), weighed one after another as the scheduler weighs them, after the step's
    first hit (loaded before it) and ``running`` requests from the last step."""
    first = w.hit_ms(4, 0, 6, 64)
    step = StepSoFar(requests=running + 1, loads=1, added_ms=sum(first) if first else 0.0)
    out = []
    for coming in reversed(range(n)):
        joins = w.joins_step(w.hit_ms(4, 0, 6, 64), step, coming)
        out.append(joins)
        if joins:
            cost = w.hit_ms(4, 0, 6, 64)
            assert cost is not None
            step.requests, step.loads, step.added_ms = (
                step.requests + 1,
                step.loads + 1,
                step.added_ms + sum(cost),
            )
        else:
            step.beside += 1
    return out


def test_a_burst_of_hits_splits_into_a_wave_in_the_step_and_one_beside_it():
    """Loads of 0.5 ms (4 blocks); a hit's compute 1.2 ms (6 tokens at 0.01 ms, and 1.14 ms
    for its 405 pairs of attention over the 64 before them), each step 0.6 ms over: of
    eleven further hits the first three join the step (the waits summed fall while they
    do), the other eight load during its forward and compute in the next. A lone further
    hit, on an engine running a request, loads beside the step: its load would hold up
    both requests already in it."""
    w = Worth()
    assert w.joins_step(w.hit_ms(4, 0, 6, 64), StepSoFar(requests=1), 0) is None  # not measured
    for step in range(1, MIN_SAMPLES + 1):  # loads: 0.1 ms + 0.1 ms a block
        blocks = 1 + step % 4
        w.planned(f"r{step}", blocks, 0, load_async=False)
        w.step_built(step, 0)
        w.step_done(step, 0.0, 0.1 + 0.1 * blocks, BS, failed=False)
    assert w.joins_step(w.hit_ms(4, 0, 6, 64), StepSoFar(requests=1), 0) is None  # no forward yet
    plane_steps(w, 0.6, 0.01, 1.14 / attention_pairs(6, 64))
    assert hits_of(w, 11, running=1) == [True] * 3 + [False] * 8
    assert hits_of(w, 1, running=1) == [False]


def test_hits_all_of_one_size_are_weighed_by_their_time_per_block():
    """Loads all of 4 blocks (2.2 ms) fit no line, so no hit is refused; a step's further
    hits are still weighed, at their 0.55 ms a block (overhead included): of four hits of 1
    block, two join the step, of four of 8 blocks none does."""
    w = Worth()
    for step in range(1, 2 * MIN_SAMPLES + 1):
        w.planned(f"r{step}", 4, 0, load_async=False)
        w.step_built(step, 64 * step)
        w.step_done(step, 0.01 * 64 * step, 2.2, BS, failed=False)
    assert w.load_ms(4, 0) is None and w.decide(4, 0, BS).load
    assert w.hit_ms(1, 0, 6, 64) == (pytest.approx(0.55), pytest.approx(0.06))
    assert w.hit_ms(4, 4, 6, 64) is None  # SSD blocks: not measured
