"""Names of a pool's Ray actors and shared regions.

Node actors carry their node id and slot (local device/rank), so a restarted engine on
the same node and device finds the same actor (``get_if_exists``).
"""

from __future__ import annotations


def manager_name(pool: str) -> str:
    return f"{pool}.manager"


def client_name(pool: str, node_id: str, slot: int) -> str:
    """The BackendClient of local device/rank ``slot`` on node ``node_id``."""
    return f"{pool}.client.{node_id}.{slot}"


def lookup_name(pool: str, node_id: str) -> str:
    """The Lookup actor of node ``node_id`` (serves every scheduler there)."""
    return f"{pool}.lookup.{node_id}"


def ssd_name(pool: str, node_id: str, slot: int) -> str:
    """The SSD offload actor of local device/rank ``slot`` on node ``node_id``."""
    return f"{pool}.ssd.{node_id}.{slot}"


def parse_node_actor(pool: str, name: str) -> tuple[str, str, int | None] | None:
    """``(kind, node_id, slot)`` of one of pool ``pool``'s node actors named ``name``
    (kind: ``client``, ``ssd`` or ``lookup``, whose slot is None); None for other names."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != pool:
        return None
    kind, node_id, rest = parts[1], parts[2], parts[3:]
    if kind == "lookup" and not rest:
        return kind, node_id, None
    if kind in ("client", "ssd") and len(rest) == 1 and rest[0].isdigit():
        return kind, node_id, int(rest[0])
    return None


def placement_group_name(pool: str) -> str:
    """The placement group pools of kvray versions before per-node clients used."""
    return f"{pool}.pg"


def region_prefix(pool: str) -> str:
    """Prefix of the pool's shared regions: ``kvray-<pool>[-kv]-<pid>-<n>``."""
    return f"kvray-{pool}"
