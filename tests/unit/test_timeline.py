"""The per-request timeline's worker-side step clock and its aggregation across ranks."""

from __future__ import annotations

import time

from kvray.connector.timeline import RequestClock, StepClock, StepTimes


def test_step_clock_separates_load_wait_forward_and_save():
    clock = StepClock()
    assert clock.times(0) is None  # no step bound
    clock.bind(7)
    clock.loaded(0.010, waited=True, served=0.006)  # sync loads before the forward
    time.sleep(0.03)  # "the forward" (plus the 10 ms above, had they really passed)
    clock.loaded(0.005, waited=True, served=0.009)  # served counts at most the wait
    start = time.perf_counter()
    clock.saving(start, 0.004)
    times = clock.times(0)
    assert times is not None and times.step == 7
    assert times.load_wait_ms == 15.0 and times.save_ms == 4.0
    assert times.load_served_ms == 11.0  # 6 + 5: the BackendClient's share of the wait
    # bound -> saving start, minus the 15 ms spent in the connector
    assert 10.0 <= times.forward_ms <= 30.0 + 50.0
    assert clock.times(0) is None  # once per step


def test_async_load_submission_is_not_a_wait():
    clock = StepClock()
    clock.bind(1)
    clock.loaded(0.002, waited=False)
    clock.async_served({"a": 0.004})  # async loads reported ended this step, each its own
    clock.async_served({"b": 0.003})
    times = clock.times(0)
    assert times is not None and times.load_wait_ms == 0.0 and times.load_served_ms == 0.0
    assert times.async_served_ms == {"a": 4.0, "b": 3.0}
    clock.bind(2)  # a new step starts from nothing
    times = clock.times(0)
    assert times is not None and times.async_served_ms == {}


def test_ranks_aggregate_to_the_slowest():
    a = StepTimes(3, load_wait_ms=1.0, forward_ms=20.0, save_ms=0.5, load_served_ms=0.9,
                  saved_through=3, async_served_ms={"r1": 6.0, "r2": 1.0})  # fmt: skip
    b = StepTimes(3, load_wait_ms=4.0, forward_ms=18.0, save_ms=0.7, load_served_ms=2.5,
                  saved_through=1, async_served_ms={"r1": 2.0, "r3": 5.0})  # fmt: skip
    agg = a.aggregate(b)
    # The slowest rank's load wait, with its own served share; saves ended on every rank
    # only through the earliest rank's step; each request's async load at the slowest
    # rank that ended it.
    assert agg == StepTimes(3, 4.0, 20.0, 0.7, 2.5, 1, {"r1": 6.0, "r2": 1.0, "r3": 5.0})


def test_request_clock_measures_from_first_sight():
    clock = RequestClock(arrival_wall=time.time() - 0.05)
    assert 40.0 <= clock.timeline.arrival_lag_ms <= 5000.0
    time.sleep(0.01)
    assert clock.now_ms() >= 10.0
    assert RequestClock(None).timeline.arrival_lag_ms == 0.0
    assert set(clock.timeline.as_dict()) >= {"lookup_sent_ms", "first_token_ms", "forward_ms"}
