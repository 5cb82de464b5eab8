"""What the scheduler side takes from its workers' handshake (vLLM's handshake metadata,
collected once after the workers registered their KV caches and before any request): the
block geometry of every rank, which every key names, so lookups ask for the keys the
workers store; where each rank's worker loads through (the SSD tier a lookup asks for
that rank's keys); and the load-failure policy vLLM applies to this connector
(:mod:`kvray.connector.load_policy`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from kvray.connector.load_policy import FAIL
from kvray.errors import ConfigError

if TYPE_CHECKING:
    from kvray.index.lookup import Place, Placement
    from kvray.keys import KeySpace


class Handshake(NamedTuple):
    """The workers' handshakes, merged."""

    geometries: dict[int, str]
    places: dict[int, Place]
    policy: str
    """``fail`` when any worker read it (or none said): the policy that ends requests wins."""


def merged(metadata: Iterable[object]) -> Handshake:
    """Every KVRayConnector worker's handshake of ``metadata``, merged; none is a
    configuration error naming its cause."""
    from kvray.connector.metadata import KVRayHandshake

    ours = [m for m in metadata if isinstance(m, KVRayHandshake)]
    if not ours:
        raise ConfigError(
            "KVRayConnector's scheduler received no block geometry from its workers (the "
            "handshake metadata vLLM collected is another connector's: MultiConnector "
            "passes on only its first connector's): list KVRayConnector first in "
            "MultiConnector's connectors"
        )
    geometries: dict[int, str] = {}
    places: dict[int, Place] = {}
    for m in ours:
        geometries.update(m.geometries)
        places.update(m.places)
    policies = {m.load_failure_policy for m in ours} - {""}
    policy = FAIL if FAIL in policies or not policies else policies.pop()
    return Handshake(geometries, places, policy)


def with_geometries(space: KeySpace, geometries: dict[int, str]) -> KeySpace:
    """``space`` naming every rank's (and layer group's) geometry; a rank the workers did
    not report is an error: its keys would be asked for under no geometry."""
    full = tuple(geometries.get(r, "") for r in range(space.world_size * space.kv_groups))
    space = replace(space, geometries=full)
    if not space.complete:
        missing = [r for r, g in enumerate(full) if not g]
        raise ConfigError(
            f"KVRayConnector's scheduler received the block geometry of ranks "
            f"{sorted(geometries)} but not of {missing}: vLLM's handshake metadata missed "
            "workers (kvray's bug, or a vLLM whose executor does not collect it)"
        )
    return space


def placement(
    places: dict[int, Place], ranks: int, warn: Callable[[list[int]], None]
) -> Placement | None:
    """Instance rank -> the place its worker loads through, when every rank's worker named
    one; otherwise None (lookups ask this node's slot per rank, as for a one-node
    instance), after ``warn(missing ranks)``."""
    missing = [r for r in range(ranks) if r not in places]
    if missing:
        warn(missing)
        return None
    return {r: places[r] for r in range(ranks)}
