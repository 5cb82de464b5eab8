"""Names of a pool's Ray actors, placement group and shared-memory files.

Every process finds its rank's actors with ``ray.get_actor(name, namespace=...)``.
"""

from __future__ import annotations


def manager_name(pool: str) -> str:
    return f"{pool}.manager"


def backend_name(pool: str, rank: int) -> str:
    return f"{pool}.backend.{rank}"


def lookup_name(pool: str, rank: int) -> str:
    return f"{pool}.lookup.{rank}"


def ssd_name(pool: str, rank: int) -> str:
    return f"{pool}.ssd.{rank}"


def placement_group_name(pool: str) -> str:
    return f"{pool}.pg"


def region_prefix(pool: str) -> str:
    """Prefix of the pool's files under /dev/shm: ``kvray-<pool>-<pid>-<n>``."""
    return f"kvray-{pool}"
