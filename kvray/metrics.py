"""The pool's side on Prometheus, through Ray's metrics (``ray.util.metrics``).

Every pool actor exports its counters every :data:`EXPORT_S`; Ray's metrics agent on
each node serves them, with Ray's own, at ``http://<node>:<metrics_export_port>/metrics``
(what Ray's Prometheus service discovery scrapes). Ray prefixes every name with
``ray_``: ``kvray_get_bytes`` is scraped as ``ray_kvray_get_bytes_total``. Labels:
``pool``, ``node`` (the Ray node id's first 12 characters), ``slot`` (the local rank;
empty for a node's Lookup actor and the manager), ``role`` (``client``, ``ssd``,
``lookup``, ``manager``). The manager also exports the pool's server-side view where kvray
runs the server itself and it has one (the embedded ``mooncake_master``'s capacity, used
bytes, keys and evictions).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from kvray.stats import RankStats
from kvray.warn_once import WarnOnce

logger = logging.getLogger(__name__)

EXPORT_S = 5.0
"""How often an actor hands its counters to Ray (Ray reports them every 10 s)."""

COUNTERS: dict[str, tuple[str, str]] = {
    "put_keys": ("kvray_put_blocks", "Blocks (keys) stored"),
    "put_bytes": ("kvray_put_bytes", "Bytes stored"),
    "put_failed": ("kvray_put_failed_blocks", "Blocks whose store failed (not for space)"),
    "put_pool_full": ("kvray_put_pool_full_blocks", "Blocks not stored: the pool was full"),
    "get_keys": ("kvray_get_blocks", "Blocks (keys) loaded"),
    "get_bytes": ("kvray_get_bytes", "Bytes loaded"),
    "get_corrupt": ("kvray_corrupt_blocks", "Blocks whose bytes failed their checksum on load"),
    "removed": ("kvray_removed_blocks", "Blocks removed through kvray"),
    "lookups": ("kvray_lookups", "Prefix lookups answered"),
    "lookup_blocks": ("kvray_lookup_blocks", "Blocks looked up"),
    "lookup_hit_blocks": ("kvray_lookup_hit_blocks", "Blocks looked up and found (leading)"),
    "lookup_ssd_blocks": ("kvray_lookup_ssd_blocks", "Lookup hits only the SSD tier held"),
    "index_lookups": (
        "kvray_index_lookups",
        "Of the lookups, those the node's block index answered",
    ),
    "pins": ("kvray_pins", "Steps' loads pinned (lookups answered from the node's index)"),
    "pin_failures": ("kvray_pin_failures", "Pins that failed (their blocks loaded unpinned)"),
    "ssd_put_keys": ("kvray_ssd_put_blocks", "Blocks written to the SSD tier"),
    "ssd_get_keys": ("kvray_ssd_get_blocks", "DRAM misses the SSD tier served"),
    "ssd_get_bytes": ("kvray_ssd_get_bytes", "Bytes the SSD tier served"),
    "ssd_evictions": ("kvray_ssd_evicted_blocks", "Blocks the SSD tier evicted"),
    "ssd_corrupt": ("kvray_ssd_corrupt_blocks", "SSD blocks that failed their checksum"),
    "evictions_found": (
        "kvray_evictions_found_blocks",
        "Blocks a client stored that its eviction sweep found evicted",
    ),
}
GAUGES: dict[str, tuple[str, str]] = {
    "regions": ("kvray_regions", "Shared regions mapped by a client"),
    "ssd_blocks": ("kvray_ssd_blocks", "Blocks on the SSD tier"),
    "ssd_used_bytes": ("kvray_ssd_used_bytes", "Bytes on the SSD tier"),
}
MISSED = ("kvray_missed_blocks", "Blocks not served from the pool, by reason (kvray.misses)")
SEGMENT = ("kvray_segment_bytes", "Memory a client contributes to the pool")
SERVER_GAUGES = {
    "master_total_capacity_bytes": ("kvray_pool_capacity_bytes", "The pool's memory"),
    "master_allocated_bytes": ("kvray_pool_used_bytes", "The pool's memory in use"),
    "master_key_count": ("kvray_pool_keys", "Keys the pool holds"),
}
SERVER_COUNTERS = {
    "master_evicted_key_count": ("kvray_pool_evicted_blocks", "Keys the server evicted"),
    "master_evicted_size_bytes": ("kvray_pool_evicted_bytes", "Bytes the server evicted"),
}
SERVER_KEYS = frozenset(SERVER_GAUGES) | frozenset(SERVER_COUNTERS)
TAG_KEYS = ("pool", "node", "slot", "role")


class StatsExporter:
    """One actor's :class:`RankStats` as Ray metrics: counters advance by what changed
    since the last :meth:`export`, gauges are set."""

    def __init__(self, pool: str, role: str, node_id: str, slot: int | None = None) -> None:
        from ray.util import metrics

        self._tags = {
            "pool": pool,
            "node": node_id[:12],
            "slot": "" if slot is None else str(slot),
            "role": role,
        }

        def made(kind: Any, specs: dict[str, tuple[str, str]]) -> dict[str, Any]:
            return {
                k: kind(name, description=doc, tag_keys=TAG_KEYS)
                for k, (name, doc) in specs.items()
            }

        self._counters = made(metrics.Counter, COUNTERS)
        self._gauges = made(metrics.Gauge, GAUGES)
        self._missed = metrics.Counter(
            MISSED[0], description=MISSED[1], tag_keys=(*TAG_KEYS, "reason")
        )
        self._segment = metrics.Gauge(SEGMENT[0], description=SEGMENT[1], tag_keys=TAG_KEYS)
        self._server_gauges = made(metrics.Gauge, SERVER_GAUGES)
        self._server_counters = made(metrics.Counter, SERVER_COUNTERS)
        self._seen: dict[str, float] = {}
        """Each counter's value at the last export (counters advance by the difference)."""

    def _advance(self, counter: Any, key: str, value: float, tags: dict[str, str]) -> None:
        delta = value - self._seen.get(key, 0.0)
        if delta > 0:
            counter.inc(delta, tags=tags)
        self._seen[key] = value

    def export(self, stats: RankStats, segment_bytes: int | None = None) -> None:
        for name, counter in self._counters.items():
            self._advance(counter, name, getattr(stats, name), self._tags)
        for name, gauge in self._gauges.items():
            gauge.set(getattr(stats, name), tags=self._tags)
        # Lookups count the lookup-time reasons, clients the load-time ones.
        for reason, n in stats.misses().items():
            tags = {**self._tags, "reason": reason}
            self._advance(self._missed, f"missed:{reason}", n, tags)
        if segment_bytes is not None:
            self._segment.set(segment_bytes, tags=self._tags)

    def export_server(self, values: dict[str, float]) -> None:
        """The server's own metrics (names as the server has them)."""
        for key, gauge in self._server_gauges.items():
            if key in values:
                gauge.set(values[key], tags=self._tags)
        for key, counter in self._server_counters.items():
            if key in values:
                self._advance(counter, key, values[key], self._tags)


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """A Prometheus text endpoint's unlabelled samples (a server's own ``/metrics``)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


def describe() -> list[tuple[str, str, str]]:
    """``(name as scraped, type, help)`` of every metric the pool exports (for docs)."""
    rows = [(f"ray_{n}_total", "counter", d) for n, d in COUNTERS.values()]
    rows += [(f"ray_{MISSED[0]}_total{{reason}}", "counter", MISSED[1])]
    rows += [(f"ray_{n}", "gauge", d) for n, d in GAUGES.values()]
    rows += [(f"ray_{SEGMENT[0]}", "gauge", SEGMENT[1])]
    rows += [(f"ray_{n}", "gauge", d) for n, d in SERVER_GAUGES.values()]
    rows += [(f"ray_{n}_total", "counter", d) for n, d in SERVER_COUNTERS.values()]
    return rows


async def export_forever(
    pool: str, role: str, slot: int | None, read: Callable[[], Awaitable[Snapshot]]
) -> None:
    """An actor's export loop: every :data:`EXPORT_S`, ``read()`` -> ``(stats,
    segment_bytes)`` handed to Ray. A failure is logged once and never ends the actor."""
    from kvray import remote

    warn = WarnOnce(logger)
    exporter: StatsExporter | None = None
    while True:
        await asyncio.sleep(EXPORT_S)
        try:
            if exporter is None:
                exporter = StatsExporter(pool, role, remote.node_id(), slot)
            stats, segment = await read()
            exporter.export(stats, segment)
        except Exception as exc:  # a metrics failure must not fail the pool
            warn("export", "kvray %s: exporting metrics to Ray failed (%s)", role, exc)


Snapshot = tuple[RankStats, int | None]
