"""Scheduler side: every request's :class:`~kvray.connector.timeline.Timeline`, from first
sight to its first token, logged at DEBUG once complete.

A request finishes (in vLLM's handling of a step's output) before that step's connector
output brings the worker's times, so a finished request whose first-token step's times
are still to come is parked until they arrive, or until a thousand steps passed without
them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvray.connector.timeline import RequestClock, StepTimes

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvray.connector.request_state import RequestState

STEPS_KEPT = 1000
"""Steps a first-token step waits for its times before its requests are logged without."""


class RequestTimelines:
    """The scheduler side's request clocks, logged on ``logger`` at DEBUG."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._clocks: dict[str, RequestClock] = {}
        self._first_token_steps: dict[int, list[str]] = {}
        """Step -> requests whose first token that step computes."""
        self._parked: dict[str, RequestClock] = {}
        """Finished requests whose first-token step's times are still to come."""

    def clock(self, request: Request) -> RequestClock:
        clock = self._clocks.get(request.request_id)
        if clock is None:
            arrival = getattr(request, "arrival_time", None)
            clock = self._clocks[request.request_id] = RequestClock(arrival)
        return clock

    def step_built(
        self, step: int, scheduled: dict[str, int], reqs: dict[str, RequestState]
    ) -> None:
        """Step ``step`` was built: note the step that completes each request's prompt (it
        samples the first token) and the prefill steps before it."""
        for old in [s for s in self._first_token_steps if s < step - STEPS_KEPT]:
            for rid in self._first_token_steps.pop(old):  # no step times ever came
                self._log_parked(rid)
        for rid in scheduled:
            st, clock = reqs.get(rid), self._clocks.get(rid)
            if st is None or clock is None or clock.first_step is not None:
                continue
            clock.timeline.prefill_steps += 1
            if st.computed_tokens >= st.request.num_prompt_tokens:
                clock.first_step = step
                clock.timeline.first_step_built_ms = clock.now_ms()
                self._first_token_steps.setdefault(step, []).append(rid)

    def step_times(self, times: StepTimes) -> None:
        """A step's output is back: the first tokens it computed are out."""
        for step in [s for s in self._first_token_steps if s <= times.step]:
            for rid in self._first_token_steps.pop(step):
                clock = self._clocks.get(rid) or self._parked.get(rid)
                if clock is None:
                    continue
                tl = clock.timeline
                tl.first_token_ms = clock.now_ms()
                if step == times.step:
                    tl.load_wait_ms, tl.forward_ms = times.load_wait_ms, times.forward_ms
                    tl.load_served_ms = times.load_served_ms
                    tl.save_ms = times.save_ms
                self._log_parked(rid)

    def async_served(self, served_ms: Mapping[str, float]) -> None:
        """A rank ended these requests' async loads: the BackendClient's own time serving
        each (the slowest rank's counts)."""
        for rid, ms in served_ms.items():
            clock = self._clocks.get(rid)
            if clock is not None:
                clock.timeline.async_served_ms = max(ms, clock.timeline.async_served_ms or 0.0)

    def async_loaded(self, rids: set[str]) -> None:
        """The async loads of ``rids`` ended on every rank (reported in a step's output)."""
        for rid in rids:
            clock = self._clocks.get(rid)
            if clock is not None and clock.timeline.async_loaded_ms is None:
                clock.timeline.async_loaded_ms = clock.now_ms()

    def finished(self, rid: str, st: RequestState | None) -> None:
        """``rid`` finished: logged now, or once its first-token step's times came."""
        clock = self._clocks.pop(rid, None)
        if clock is None or st is None:
            return
        tl = clock.timeline
        tl.hit_pool, tl.loaded, _ = st.totals()
        if clock.first_step is not None and tl.first_token_ms is None:
            self._parked[rid] = clock
        else:
            self._log(rid, clock)

    def _log_parked(self, rid: str) -> None:
        clock = self._parked.pop(rid, None)
        if clock is not None:
            self._log(rid, clock)

    def _log(self, rid: str, clock: RequestClock) -> None:
        if not self._logger.isEnabledFor(logging.DEBUG):
            return
        tl = clock.timeline

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        self._logger.debug(
            "timeline request_id=%s arrival_lag=%s lookup_sent=%s lookup_answered=%s%s "
            "lookup_wait_steps=%d admitted=%s async_loaded=%s (served %s) first_step_built=%s "
            "load_wait=%s "
            "(served %s) forward=%s "
            "first_token=%s prefill_steps=%d (ms from first sight)",
            rid,
            ms(tl.arrival_lag_ms),
            ms(tl.lookup_sent_ms),
            ms(tl.lookup_answered_ms),
            " (timed out)" if tl.lookup_timed_out else "",
            tl.lookup_wait_steps,
            ms(tl.admitted_ms),
            ms(tl.async_loaded_ms),
            ms(tl.async_served_ms),
            ms(tl.first_step_built_ms),
            ms(tl.load_wait_ms),
            ms(tl.load_served_ms),
            ms(tl.forward_ms),
            ms(tl.first_token_ms),
            tl.prefill_steps,
            extra={"kvray_timeline": {"request_id": rid, **tl.as_dict()}},
        )
