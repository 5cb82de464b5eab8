"""The connector's log lines that tools read back: written with these formats (by
:mod:`kvray.connector.scheduler`) and parsed here, and nowhere else.

- one line per finished request, with its block counts::

    request_id=cmpl-1 total_blocks=4 hit_local=0 hit_pool=4 loaded=4 failed=0 saved=0
    request_id=cmpl-2 total_blocks=4 hit_local=0 hit_pool=1 loaded=1 failed=0 saved=3 miss=evicted

- one line when the scheduler knows its keys (the workers' block geometries arrived)::

    KVRayConnector scheduler: keys tiny-m0123456789ab@float32-b128-h4x64, block geometries 5f..,a1..

In an engine's own log, vLLM prefixes the lines of an engine-core process with
``(EngineCore_DP0 pid=1234)``: :attr:`RequestLine.engine_pid` is that pid, when present.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from kvray.keys import KeySpace

REQUEST_FORMAT = (
    "request_id=%s total_blocks=%d hit_local=%d hit_pool=%d loaded=%d failed=%d saved=%d"
)
"""The per-request line; its arguments in the order of :data:`COUNTS` after the id. A
request whose lookup missed some of its blocks adds `` miss=<reason>``: one of
kvray.misses' reasons, or ``save_in_flight`` (the block's save by this instance had not
ended, or the node's index did not show it yet, when the lookup timeout ran out)."""
REQUEST_MISS_FORMAT = REQUEST_FORMAT + " miss=%s"
ESTIMATE_FORMAT = " est_load_ms=%.2f est_compute_ms=%.2f"
"""Added to the per-request line where the hit was weighed against computing it (both of
this engine's rates measured, ``recompute_slow_hits``): what loading it and computing its
tokens were estimated to cost. ``miss=not_worth_loading`` says it was computed."""
COUNTS = ("total_blocks", "hit_local", "hit_pool", "loaded", "failed", "saved")
KEYS_FORMAT = "KVRayConnector scheduler: keys %s@%s, block geometries %s%s"
"""Namespace, layout, the block geometries of every rank and KV cache group (rank-major)
joined by commas, and ``, kv_groups K`` for a hybrid model's ``K`` > 1 groups (then
`` (state 0,1,2)`` names its state groups, if any), or ``, one copy across TP`` (MLA:
every TP rank loads TP rank 0's keys)."""

_REQUEST = re.compile(
    r"(?:\(EngineCore\S* pid=(\d+)\).*?)?request_id=(\S+) "
    + " ".join(rf"{name}=(\d+)" for name in COUNTS)
    + r"(?: miss=(\S+))?"
    + r"(?: est_load_ms=([\d.]+) est_compute_ms=([\d.]+))?"
)
_KEYS = re.compile(
    r"KVRayConnector scheduler: keys ([^\s@]+)@(\S+), block geometries ([0-9a-f]+(?:,[0-9a-f]+)*)"
    r"(?:, kv_groups (\d+)(?: \(state ([\d,]+)\))?)?(, one copy across TP)?"
)


@dataclass(frozen=True)
class RequestLine:
    """One finished request's block counts, as the connector logged them."""

    request_id: str
    total_blocks: int
    hit_local: int
    hit_pool: int
    loaded: int
    failed: int
    saved: int
    engine_pid: str | None = None
    """The engine-core process that logged it, where vLLM's prefix names one."""
    miss: str = ""
    """Why its lookup stopped short (empty: a whole hit, or no lookup)."""
    est_load_ms: float | None = None
    """What loading its pool hit was estimated to cost (None: not weighed)."""
    est_compute_ms: float | None = None
    """What computing that hit's tokens instead was estimated to cost."""

    @property
    def counts(self) -> dict[str, int]:
        """The counts alone, by name (for comparing a whole line at once)."""
        return {name: getattr(self, name) for name in COUNTS}


def groups_note(space: KeySpace) -> str:
    """The keys line's tail: one copy across TP (MLA), a hybrid model's group count and
    state groups."""
    if space.tp_replicated:
        return ", one copy across TP"
    if space.kv_groups < 2:
        return ""
    states = f" (state {','.join(map(str, space.state_groups))})" if space.state_groups else ""
    return f", kv_groups {space.kv_groups}{states}"


def log_request(logger: logging.Logger, line: RequestLine) -> None:
    """Log ``line`` at INFO (the record carries it whole as ``kvray_request``)."""
    fmt = REQUEST_MISS_FORMAT if line.miss else REQUEST_FORMAT
    args: tuple[object, ...] = (line.request_id, *line.counts.values())
    if line.miss:
        args += (line.miss,)
    if line.est_load_ms is not None:
        fmt += ESTIMATE_FORMAT
        args += (line.est_load_ms, line.est_compute_ms)
    logger.info(fmt, *args, extra={"kvray_request": line})


def request_lines(log: str) -> list[RequestLine]:
    """Every per-request line in ``log``, in order."""
    out = []
    for pid, rid, *counts, miss, load, compute in _REQUEST.findall(log):
        total, local, pool, loaded, failed, saved = (int(x) for x in counts)
        est = (float(load), float(compute)) if load else (None, None)
        out.append(
            RequestLine(rid, total, local, pool, loaded, failed, saved, pid or None, miss, *est)
        )
    return out


def request_counts(log: str) -> list[dict[str, int]]:
    """The counts of every per-request line in ``log``, in order."""
    return [line.counts for line in request_lines(log)]


def key_space(log: str, *, pp_size: int = 1, layer_groups: int = 1) -> KeySpace | None:
    """The keys the scheduler logged (the first such line in ``log``), or None before it
    logged them. The namespace (with the model digest unless ``model_namespace`` set it)
    and each rank's geometry come from the engine; ``pp_size`` and ``layer_groups`` say
    how its ranks are laid out."""
    found = _KEYS.search(log)
    if found is None:
        return None
    namespace, layout, geometries, kv_groups, states, replicated = found.groups()
    g = tuple(geometries.split(","))
    k = int(kv_groups or 1)
    state = tuple(int(s) for s in states.split(",")) if states else ()
    tp = len(g) // (pp_size * k)
    return KeySpace(namespace, layout, tp, pp_size, layer_groups, g, k, state, bool(replicated))


def log_through_vllm() -> None:
    """Send kvray's records to vLLM's handlers (its format, its level switch), unless the
    application configured the ``kvray`` logger itself."""
    ours = logging.getLogger("kvray")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    # INFO, or DEBUG with vLLM's (VLLM_LOGGING_LEVEL=DEBUG: per-request timelines too).
    ours.setLevel(min(logging.INFO, theirs.getEffectiveLevel()))
    ours.propagate = False
