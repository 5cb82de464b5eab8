"""Connector counters through vLLM's stats hooks (aggregated across workers, reduced
per logging interval)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

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
)


@dataclass
class KVRayConnectorStats(KVConnectorStats):
    """Plain counters; ``data`` maps each name in :data:`COUNTERS` to an int."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: int = 1) -> None:
        self.data[name] += value

    def reset(self) -> None:
        for name in COUNTERS:
            self.data[name] = 0

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
        return not any(self.data[name] for name in COUNTERS)

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
