"""Counters that aggregate across ranks (like vLLM's KVConnectorStats)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvray.misses import LOOKUP_REASONS


@dataclass
class RankStats:
    """What one rank's BackendClient and Lookup actors did since they started."""

    put_keys: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    put_pool_full: int = 0
    get_keys: int = 0
    get_bytes: int = 0
    get_missed: int = 0
    get_failed: int = 0
    get_corrupt: int = 0
    """Blocks whose bytes failed their checksum on load (not in ``get_failed``)."""
    removed: int = 0
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    lookup_timeouts: int = 0
    lookup_errors: int = 0
    regions: int = 0
    ssd_put_keys: int = 0
    """Blocks the pipeline also wrote to the SSD tier."""
    ssd_get_keys: int = 0
    """DRAM misses served by the SSD tier."""
    ssd_get_bytes: int = 0
    lookup_ssd_blocks: int = 0
    """Blocks of lookup hits that only the SSD tier holds."""
    index_lookups: int = 0
    """Of ``lookups``, those schedulers answered from the node's block index (reported to
    the Lookup actor, no call per lookup)."""
    pins: int = 0
    """Pin calls: a step's blocks answered from the node's index, leased until loaded."""
    pin_failures: int = 0
    ssd_blocks: int = 0
    ssd_used_bytes: int = 0
    ssd_evictions: int = 0
    ssd_corrupt: int = 0
    evictions_found: int = 0
    """DRAM blocks this client stored that its eviction sweep found evicted (published
    gone: a lookup misses them as ``evicted``; kvray/store/index_publisher.py)."""
    miss_not_stored: int = 0
    """Looked-up blocks missed, by reason (kvray.misses): counted by the Lookup actors."""
    miss_evicted: int = 0
    miss_removed: int = 0
    miss_partial_ranks: int = 0
    miss_other_fingerprint: int = 0
    miss_lookup_timeout: int = 0
    miss_lookup_error: int = 0
    miss_not_worth_loading: int = 0
    """Blocks of hits an engine computed instead of loading (reported by its scheduler;
    also in ``lookup_hit_blocks``)."""

    def merge(self, other: RankStats) -> RankStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankStats:
        return cls(**{f.name: int(d.get(f.name, 0)) for f in fields(cls)})

    def misses(self) -> dict[str, int]:
        """Missed blocks by reason: the lookups' (``miss_*``), and the loads' (a get that
        found nothing in any tier, ``gone_at_load``; one that failed, ``load_failed``; one
        whose bytes failed their checksum, ``corrupt``)."""
        out = {r: getattr(self, f"miss_{r}") for r in LOOKUP_REASONS}
        # A DRAM miss the SSD tier served was no miss.
        out["gone_at_load"] = max(0, self.get_missed - self.ssd_get_keys)
        out["load_failed"] = self.get_failed
        out["corrupt"] = self.get_corrupt
        return out

    @property
    def lookup_hit_rate(self) -> float:
        return self.lookup_hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0
