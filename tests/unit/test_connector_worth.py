"""The rates a hit's load is judged by: robust straight lines, none from one sample or one
size, and a refused tier measured again now and then."""

from __future__ import annotations

from kvray.connector.worth import MIN_SAMPLES, PROBE_EVERY, STEPS_KEPT, Line, Worth

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


def test_a_further_hit_joins_a_step_it_delays_less_than_a_step_takes():
    """``load_async: auto``: a step's further hit loads before the forward when its load and
    its compute, times the requests already in the step, are at most what a step has been
    measured to take (here the last 8 forwards' median, 8.0 ms)."""
    w = Worth()
    assert w.joins_step(4, 0, 6, waiting=1) is None  # nothing measured: not weighed
    slow_loads(w)
    # 4 blocks load in 2.2 ms, 6 tokens compute in 0.06: 2.26 ms added per request waiting
    assert w.joins_step(4, 0, 6, waiting=3)  # 6.78 ms <= 8.0
    assert not w.joins_step(4, 0, 6, waiting=4)  # 9.04 ms
    # 256 tokens left to compute add 2.56 ms more: only a step holding one request takes it
    assert w.joins_step(4, 0, 256, waiting=1)
    assert not w.joins_step(4, 0, 256, waiting=2)


def test_hits_all_of_one_size_are_weighed_by_their_time_per_block():
    """Loads all of 4 blocks (2.2 ms) fit no line, so no hit is refused; a step's further
    hit is still weighed, at their 0.55 ms a block (overhead included)."""
    w = Worth()
    for step in range(1, 2 * MIN_SAMPLES + 1):
        w.planned(f"r{step}", 4, 0, load_async=False)
        w.step_built(step, 64 * step)
        w.step_done(step, 0.01 * 64 * step, 2.2, BS, failed=False)
    assert w.load_ms(4, 0) is None and w.decide(4, 0, BS).load
    assert w.joins_step(4, 0, 6, waiting=3)  # 3 * (2.2 + 0.06) = 6.78 ms <= 8.0
    assert not w.joins_step(8, 0, 6, waiting=3)  # 3 * (4.4 + 0.06)
    assert w.joins_step(4, 4, 6, waiting=1) is None  # SSD blocks: not measured
