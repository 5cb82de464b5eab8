"""Where a request's time to first token goes, as the connector sees it.

The scheduler side stamps each request (its own process, ``time.monotonic``): when the
connector first saw it (and how long after vLLM's arrival stamp), its lookup sent and
seen answered (and how many scheduler steps it waited for that), admitted, the engine
step that computes its first token built, and that step's output back. The worker side
reports per step (:class:`StepTimes`, vLLM's worker -> scheduler connector metadata,
the slowest rank's when there are several): how long the forward waited for pool loads
(and how much of that the BackendClient spent serving them) and how long the forward
itself took. Durations only cross processes (and nodes), never
timestamps, so no two clocks are compared.

At the end of a request its :class:`Timeline` is logged at DEBUG (``kvray.connector``
logger; the record carries it as ``record.kvray_timeline``) and summed into the
connector's counters (``lookup_us``, ``lookup_wait_steps``, ``load_wait_us``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


@dataclass
class StepTimes(KVConnectorWorkerMetadata):
    """One engine step, worker side (vLLM aggregates the ranks': the slowest counts)."""

    step: int
    load_wait_ms: float = 0.0
    """Time the step waited for pool loads before (and, layer-wise, during) the forward."""
    forward_ms: float = 0.0
    """The forward, without that waiting and without the connector's own work after it."""
    save_ms: float = 0.0
    """``wait_for_save``: gathering (staged) and sending the step's saves."""
    load_served_ms: float = 0.0
    """Of ``load_wait_ms``: the time the BackendClient spent serving the loads waited for
    (its backend's get and the checksum verification), as it measured it; the rest is
    the node channel, the worker's own work (staged: the scatter) and waiting. Reported
    over the node channel; Ray calls report none (0)."""
    saved_through: int = -1
    """Every save bound in this step or before has ended (stored or failed); the
    earliest of the ranks'. -1: not known."""
    async_served_ms: dict[str, float] = field(default_factory=dict)
    """The requests whose async loads this rank reports ended in this step: the
    BackendClient's own time serving each one's load (its slowest call), as it measured
    it, i.e. the load's own time less the node channel's round trip; the rest of the
    time its request waited is the worker noticing it and the steps around it. Over Ray
    calls none is measured (empty)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, StepTimes):
            return self
        slow = self if self.load_wait_ms >= other.load_wait_ms else other
        served = dict(other.async_served_ms)
        for rid, ms in self.async_served_ms.items():
            served[rid] = max(ms, served.get(rid, 0.0))
        return StepTimes(
            max(self.step, other.step),
            slow.load_wait_ms,
            max(self.forward_ms, other.forward_ms),
            max(self.save_ms, other.save_ms),
            slow.load_served_ms,
            min(self.saved_through, other.saved_through),
            served,
        )


class StepClock:
    """Worker side: stamps of the current step, turned into :class:`StepTimes`."""

    def __init__(self) -> None:
        self.step = 0
        self._bound = 0.0
        self._in_connector = 0.0
        self._load_wait = 0.0
        self._served = 0.0
        self._save = 0.0
        self._async_served: dict[str, float] = {}
        self._forward_end = 0.0
        self.active = False

    def bind(self, step: int) -> None:
        self.step, self.active = step, True
        self._bound = time.perf_counter()
        self._in_connector = self._load_wait = self._save = self._forward_end = 0.0
        self._served = 0.0
        self._async_served = {}

    def loaded(self, seconds: float, *, waited: bool, served: float = 0.0) -> None:
        """``seconds`` spent in start_load_kv (the forward waited when ``waited``) or in
        wait_for_layer_load (waited); ``served``: of them, the BackendClient's own time."""
        self._in_connector += seconds
        if waited:
            self._load_wait += seconds
            self._served += min(served, seconds)

    def async_served(self, seconds: dict[str, float]) -> None:
        """Async loads reported ended this step: the BackendClient's own time serving
        each request's."""
        self._async_served.update(seconds)

    def saving(self, start: float, seconds: float) -> None:
        if not self._forward_end:
            self._forward_end = start
        self._save += seconds

    def times(self, saved_through: int) -> StepTimes | None:
        if not self.active:
            return None
        self.active = False
        end = self._forward_end or time.perf_counter()
        forward = max(0.0, end - self._bound - self._in_connector)
        return StepTimes(
            self.step,
            self._load_wait * 1e3,
            forward * 1e3,
            self._save * 1e3,
            self._served * 1e3,
            saved_through,
            {rid: s * 1e3 for rid, s in self._async_served.items()},
        )


@dataclass
class Timeline:
    """One request, scheduler side; milliseconds from when the connector saw it."""

    arrival_lag_ms: float = 0.0
    """From vLLM's arrival stamp to the connector seeing the request."""
    lookup_sent_ms: float | None = None
    lookup_answered_ms: float | None = None
    """When the scheduler saw the answer (or gave up on it: ``lookup_timed_out``)."""
    lookup_timed_out: bool = False
    lookup_wait_steps: int = 0
    """Scheduler steps in which the request waited for its lookup."""
    admitted_ms: float | None = None
    async_loaded_ms: float | None = None
    """Its async load's end reached the scheduler (vLLM's ``finished_recving``): from the
    next step on the request can compute."""
    async_served_ms: float | None = None
    """Of the async load, the BackendClient's own time (:class:`StepTimes`)."""
    first_step_built_ms: float | None = None
    """The step computing the first token was handed to the workers."""
    load_wait_ms: float | None = None
    load_served_ms: float | None = None
    """Of ``load_wait_ms``, the BackendClient's own time (:class:`StepTimes`)."""
    forward_ms: float | None = None
    """Of the step computing the first token (its whole prefill when it has one step)."""
    save_ms: float | None = None
    """Of that step: ``wait_for_save``, sending its saves (staged: gathering them first),
    after the forward and before the first token is sampled."""
    first_token_ms: float | None = None
    """That step's output was back in the scheduler."""
    prefill_steps: int = 0
    hit_pool: int = 0
    loaded: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class RequestClock:
    """A :class:`Timeline` being filled in, with its zero."""

    def __init__(self, arrival_wall: float | None) -> None:
        self.zero = time.monotonic()
        self.timeline = Timeline()
        if arrival_wall:
            self.timeline.arrival_lag_ms = max(0.0, (time.time() - arrival_wall) * 1e3)
        self.first_step: int | None = None

    def now_ms(self) -> float:
        return (time.monotonic() - self.zero) * 1e3
