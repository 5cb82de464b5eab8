"""A pool's status: spec, per-client counters (by node and slot), per-node capacity and
totals, as a table or a dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvray.backends.registry import spec_of
from kvray.sizes import format_size
from kvray.stats import RankStats


@dataclass
class RankStatus:
    """One node client (a slot on a node); a node's Lookup counters are on its first."""

    rank: int
    segment: str
    segment_bytes: int
    alive: bool
    stats: RankStats
    error: str = ""
    node: str = ""
    """``<ip>/<node id prefix>`` of the node the client runs on."""


@dataclass
class PoolStatus:
    name: str
    namespace: str
    backend: str
    server_address: str
    embedded: bool
    world_size: int
    ranks: list[RankStatus] = field(default_factory=list)
    ssd: bool = False
    """The pool chains kvray's SSD tier (``<backend>|ssd``)."""
    server: dict[str, float] = field(default_factory=dict)
    """The embedded server's own counters (kvray.metrics.SERVER_KEYS), where it has them."""
    fingerprints: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """``namespace@layout`` -> hash domain -> how the instances that registered it hash
    blocks; more than one domain for the same keys: those instances never share blocks."""
    engines: list[dict[str, Any]] = field(default_factory=list)
    """The engines that attached (oldest first): name (``host:pid``), model, keys, role
    and ``load_failure_policy`` (what vLLM does when a load from the pool fails)."""

    def hash_mismatches(self) -> dict[str, list[dict[str, Any]]]:
        return {k: list(v.values()) for k, v in self.fingerprints.items() if len(v) > 1}

    @property
    def total(self) -> RankStats:
        total = RankStats()
        for r in self.ranks:
            total.merge(r.stats)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "backend": self.backend,
            "server_address": self.server_address,
            "embedded": self.embedded,
            "world_size": self.world_size,
            "ssd": self.ssd,
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "segment": r.segment,
                    "segment_bytes": r.segment_bytes,
                    "alive": r.alive,
                    "error": r.error,
                    **r.stats.to_dict(),
                }
                for r in self.ranks
            ],
            "nodes": self.node_capacity(),
            "total": self.total.to_dict(),
            "misses": self.total.misses(),
            "fingerprints": self.fingerprints,
            "engines": self.engines,
            "server": self.server,
        }

    def node_capacity(self) -> dict[str, int]:
        """Memory each node contributes to the pool (its live clients' segments)."""
        out: dict[str, int] = {}
        for r in self.ranks:
            out[r.node] = out.get(r.node, 0) + (r.segment_bytes if r.alive else 0)
        return out

    def table(self) -> str:
        server = spec_of(self.backend).server_name
        mode = f"embedded {server}" if self.embedded else f"external {server}"
        head = (
            f"kvray pool {self.name!r} (namespace {self.namespace!r}): {self.backend} at "
            f"{self.server_address} ({mode}), {self.world_size} client(s) per node"
        )
        cols = [
            "node",
            "rank",
            "segment",
            "size",
            "puts",
            "put",
            "full",
            "gets",
            "got",
            "miss",
            "fail",
            "lookups",
            "hit rate",
            "regions",
        ]
        if self.ssd:
            cols += ["ssd got", "ssd hits", "ssd used", "ssd evict", "ssd bad"]
        rows = []
        for r in [*self.ranks, None]:
            s = self.total if r is None else r.stats
            rows.append(
                [
                    "total" if r is None else r.node,
                    "" if r is None else str(r.rank),
                    "" if r is None else (r.segment if r.alive else f"DOWN: {r.error}"),
                    _size_or_dash(
                        sum(x.segment_bytes for x in self.ranks) if r is None else r.segment_bytes
                    ),
                    str(s.put_keys),
                    format_size(s.put_bytes),
                    str(s.put_pool_full),
                    str(s.get_keys),
                    format_size(s.get_bytes),
                    str(s.get_missed),
                    str(s.put_failed + s.get_failed),
                    str(s.lookups),
                    f"{100 * s.lookup_hit_rate:.1f}%",
                    str(s.regions),
                ]
                + (
                    [
                        str(s.ssd_get_keys),
                        str(s.lookup_ssd_blocks),
                        format_size(s.ssd_used_bytes),
                        str(s.ssd_evictions),
                        str(s.ssd_corrupt),
                    ]
                    if self.ssd
                    else []
                )
            )
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
        capacity = self.node_capacity()
        if len(capacity) > 1:
            lines.append(
                "per node: " + ", ".join(f"{n} {_size_or_dash(b)}" for n, b in capacity.items())
            )
        if "master_total_capacity_bytes" in self.server:
            sv = self.server
            lines.append(
                f"memory (master): {format_size(int(sv.get('master_allocated_bytes', 0)))} "
                f"used of {format_size(int(sv['master_total_capacity_bytes']))}, "
                f"{int(sv.get('master_key_count', 0))} keys, "
                f"{int(sv.get('master_evicted_key_count', 0))} evicted "
                f"({self.total.evictions_found} of them found by the clients' sweeps)"
            )
        misses = {r: n for r, n in self.total.misses().items() if n}
        if misses:
            lines.append(
                "missed blocks by reason: "
                + ", ".join(f"{r.replace('_', ' ')} {n}" for r, n in misses.items())
            )
        if self.fingerprints:
            # namespace@layout of every engine that attached: the namespace names the model
            # and its digest (weights, config, KV cache dtype), unless model_namespace set it.
            lines.append("model key spaces: " + ", ".join(sorted(self.fingerprints)))
        for e in self.engines:
            policy = str(e.get("load_failure_policy"))
            says = _POLICY_SAYS.get(policy, f"is handled as {policy!r}")
            lines.append(
                f"engine {e.get('engine')} ({e.get('kv_role')}, {e.get('keys')}): "
                f"a failed load {says}"
            )
        for keys, domains in self.hash_mismatches().items():
            each = "; ".join(
                f"{d.get('hash_algo')} seeded by {d.get('seed_source')} "
                f"({d.get('instances')} instance(s), domain {d.get('hash_domain')})"
                for d in domains
            )
            lines.append(
                f"HASH MISMATCH for {keys}: {len(domains)} ways of hashing blocks ({each}); "
                "instances of different ones never share blocks: set the same PYTHONHASHSEED "
                "and --prefix-caching-hash-algo on all of them"
            )
        return "\n".join(lines)


_POLICY_SAYS = {
    "recompute": "is recomputed (kv_load_failure_policy recompute)",
    "fail": "ENDS THE REQUEST with an error (kv_load_failure_policy fail, vLLM's default)",
}


def _size_or_dash(n: int) -> str:
    """A rank's contributed memory; ``-`` where the backend's server owns it."""
    return format_size(n) if n else "-"


def rates(before: PoolStatus, after: PoolStatus, dt_s: float) -> dict[str, str]:
    """What changed per second between two snapshots (``kvray status --watch``)."""
    a, b = before.total, after.total
    dt = max(dt_s, 1e-6)

    def per_s(field: str) -> float:
        return float(max(0, getattr(b, field) - getattr(a, field))) / dt

    looked = per_s("lookup_blocks")
    hit = per_s("lookup_hit_blocks")
    return {
        "put": f"{per_s('put_bytes') / 1e9:.3f} GB/s ({per_s('put_keys'):.0f} blocks/s)",
        "get": f"{per_s('get_bytes') / 1e9:.3f} GB/s ({per_s('get_keys'):.0f} blocks/s)",
        "lookups": f"{per_s('lookups'):.1f}/s",
        "hit rate": f"{100 * hit / looked:.1f}%" if looked else "-",
    }
