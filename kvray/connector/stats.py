"""Connector counters through vLLM's stats hooks (aggregated across workers, reduced
per logging interval)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvray.misses import REASONS
from kvray.misses import counter as miss_counter

COUNTERS = (
    "lookups",
    "lookup_blocks",
    "lookup_hit_blocks",
    "lookup_misses_timeout",
    "lookup_errors",
    "loaded_blocks",
    "load_failed_blocks",
    "loaded_bytes",
    "saved_blocks",
    "save_failed_blocks",
    "saved_bytes",
    "pd_waits",
    "pd_wait_timeouts",
    "lookup_us",
    "lookup_wait_steps",
    "lookup_save_waits",
    "load_wait_us",
    "loads_joined_step",
    "loads_beside_step",
    "pd_hash_mismatches",
    "index_hits",
    "index_misses",
    "index_pins",
    "index_stale",
    *(miss_counter(r) for r in REASONS),
)

HELP = {
    "lookups": "Pool lookups (one per admitted request that may load)",
    "lookup_blocks": "Blocks looked up in the pool",
    "lookup_hit_blocks": "Blocks the pool had (leading hits)",
    "lookup_misses_timeout": "Lookups slower than lookup_timeout_ms, counted as misses",
    "lookup_errors": "Lookups that failed, counted as misses",
    "loaded_blocks": "Blocks loaded from the pool",
    "load_failed_blocks": "Blocks whose load failed (reported to vLLM)",
    "loaded_bytes": "Bytes loaded from the pool",
    "saved_blocks": "Blocks stored to the pool",
    "save_failed_blocks": "Blocks whose store failed",
    "saved_bytes": "Bytes stored to the pool",
    "pd_waits": "Decode requests that waited for their prefill's blocks",
    "pd_wait_timeouts": "Decode requests whose prefill's blocks did not all arrive in pd_wait_ms",
    "lookup_us": "Microseconds from sending lookups to the scheduler seeing their answers",
    "lookup_wait_steps": "Scheduler steps in which a request waited for its lookup",
    "lookup_save_waits": "Steps a lookup waited for a save in flight from this instance",
    "load_wait_us": "Microseconds engine steps waited for pool loads (slowest rank)",
    "loads_joined_step": "Further hits of a step (load_async auto) loaded before its forward",
    "loads_beside_step": "Further hits of a step (load_async auto) loaded while it computes",
    "pd_hash_mismatches": "Decode requests whose prefill hashes blocks differently (no wait)",
    "index_hits": "Lookups with hits answered by the node's block index, with no call",
    "index_misses": "Lookups answered as misses by the node's block index, with no call",
    "index_pins": "Steps that pinned the blocks they load from the index (one call each)",
    "index_stale": "Lookups that found the node's block index not current (asked the actor)",
    **{miss_counter(r): f"Blocks missed: {text}" for r, text in REASONS.items()},
}
assert set(HELP) == set(COUNTERS)
_ZEROS = dict.fromkeys(COUNTERS, 0)


@dataclass
class KVRayConnectorStats(KVConnectorStats):
    """Plain counters; ``data`` maps each name in :data:`COUNTERS` to an int."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: int = 1) -> None:
        self.data[name] += value

    def reset(self) -> None:
        self.data.update(_ZEROS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: int(self.data[name]) for name in COUNTERS}
        blocks = self.data["lookup_blocks"]
        out["pool_hit_rate"] = round(self.data["lookup_hit_blocks"] / blocks, 4) if blocks else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(map(self.data.__getitem__, COUNTERS))  # (every step: no generator)

    def take(self) -> KVRayConnectorStats | None:
        """This interval's counters (None if nothing happened); resets them."""
        if self.is_empty():
            return None
        snapshot = KVRayConnectorStats(data=dict(self.data))
        self.reset()
        return snapshot

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> KVRayConnectorStats:
        return cls(data=dict(data or {}))


class KVRayPromMetrics(KVConnectorPromMetrics):
    """The counters on vLLM's ``/metrics`` as ``vllm:kvray_<name>_total`` per engine.
    Needed inside MultiConnector, which requires every child that reports stats to
    export them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            if name.startswith("miss_"):
                continue
            counter = self._counter_cls(
                name=f"vllm:kvray_{name}", documentation=HELP[name], labelnames=labelnames
            )
            self._counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        # Misses by reason: one counter, labelled (vllm:kvray_missed_blocks_total{reason=...}).
        missed = self._counter_cls(
            name="vllm:kvray_missed_blocks",
            documentation="Blocks the engine looked up or loaded and did not get from the "
            "pool, by reason: " + "; ".join(f"{r}: {t}" for r, t in REASONS.items()),
            labelnames=[*labelnames, "reason"],
        )
        for reason in REASONS:
            self._counters[miss_counter(reason)] = {
                idx: missed.labels(*values, reason)
                for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(int(value))
