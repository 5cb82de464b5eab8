"""Where and how the pool's actors are made: Ray placement (hard node affinity: the KV
bytes move through the node's shared memory), names, restarts and concurrency, and the
wait until they answer. The manager makes the node actors through this module; the
launcher makes the manager (:func:`kvray.actors.manager.make_manager`).

A node actor gets the function that makes the manager again (``remake``) as an argument,
not by import: the manager makes node actors, and a node actor may make the manager
again after its node was lost."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvray import remote
from kvray.actors.backend_client import BackendClientActor
from kvray.actors.lookup import LookupActor
from kvray.actors.ssd import SsdOffloadActor
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.errors import BackendUnavailableError, HashMismatchError, KVRayError
from kvray.keys import probe_hash
from kvray.naming import client_name, lookup_name, parse_node_actor, ssd_name
from kvray.remote import (
    START_TIMEOUT_S,
    CallTimeoutError,
    LookupHandle,
    NodeActors,
    Remake,
    StoreHandle,
)

logger = logging.getLogger(__name__)


def options(
    config: PoolConfig, name: str, env: dict[str, str] | None = None, **kw: Any
) -> dict[str, Any]:
    """Actor options; ``env``: the engine's native backend knobs (they override kvray's
    defaults, the pool config's own knobs, e.g. Mooncake's offload settings, override
    them)."""
    spec = spec_of(config.backend)
    env_vars = {**spec.client_env_defaults, **(env or {}), **spec.client_env(config)}
    return {
        "name": name,
        "namespace": config.namespace,
        "get_if_exists": True,
        "lifetime": "detached" if config.detached else None,
        "runtime_env": {"env_vars": env_vars},
        **kw,
    }


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    # Hard affinity: a client elsewhere could not map the node's shared memory.
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def spawn(cls: type, opts: dict[str, Any], *args: Any) -> Any:
    """A new actor of ``cls`` (or, with ``get_if_exists``, the running one of its name)."""
    return ray.remote(cls).options(**opts).remote(*args)


async def create_node_actors(
    config: PoolConfig,
    actor_config_json: str,
    server_address: str,
    node_id: str,
    slot: int,
    env: dict[str, str] | None = None,
    remake: Remake | None = None,
) -> NodeActors:
    """Find or create slot ``slot``'s actors on ``node_id`` and wait until they answer
    (called by the pool manager, which owns them); ``env``: the requesting engine's
    native backend knobs, which new actors run with; ``remake``: how they make the
    manager again when its node was lost (:class:`~kvray.remote.ManagerLink`)."""

    def node_actor(cls: type, name: str, concurrency: int, *args: Any) -> StoreHandle:
        opts = options(
            config,
            name,
            env,
            num_cpus=config.cpus_per_rank,
            scheduling_strategy=on_node(node_id),
            max_restarts=-1,
            max_task_retries=3,
            max_concurrency=concurrency,
        )
        actor = spawn(cls, opts, actor_config_json, slot, *args)
        return StoreHandle(actor, f"{cls.__name__.removesuffix('Actor')}[{slot}]@{node_id[:8]}")

    ssd = None
    if config.ssd_tier:
        ssd = node_actor(SsdOffloadActor, ssd_name(config.name, node_id, slot), 32)
    client = node_actor(
        BackendClientActor,
        client_name(config.name, node_id, slot),
        32,
        server_address,
        ssd,
        remake,
    )
    made = [client] + ([ssd] if ssd is not None else [])
    try:
        await _check_started(made, node_id, config)
    except BaseException:
        for handle in made:  # a broken actor must not be found by name next time
            remote.kill(handle.actor)
        raise
    return NodeActors(node_id, slot, client, ssd, dict(env or {}))


async def create_lookup_actor(
    config: PoolConfig,
    actor_config_json: str,
    server_address: str,
    node_id: str,
    env: dict[str, str] | None = None,
    remake: Remake | None = None,
) -> LookupHandle:
    opts = options(
        config,
        lookup_name(config.name, node_id),
        env,
        num_cpus=0,
        scheduling_strategy=on_node(node_id),
        max_restarts=-1,
        max_task_retries=3,
        max_concurrency=64,
    )
    actor = spawn(LookupActor, opts, actor_config_json, server_address, remake)
    handle = LookupHandle(actor, f"Lookup@{node_id[:8]}")
    try:
        await _check_started([handle], node_id, config)
    except BaseException:
        remote.kill(actor)
        raise
    return handle


def find_node_actors(
    config: PoolConfig, alive: set[str]
) -> tuple[list[NodeActors], dict[str, LookupHandle]]:
    """The node actors of pool ``config`` that live on the nodes ``alive``, found by
    their names (what a restarted manager takes back)."""
    found: dict[tuple[str, str, int | None], Any] = {}
    for entry in remote.named_actors():
        parsed = parse_node_actor(config.name, entry["name"])
        if entry["namespace"] != config.namespace or parsed is None or parsed[1] not in alive:
            continue
        actor = remote.find(entry["name"], config.namespace)
        if actor is not None:  # (else gone since it was listed)
            found[parsed] = actor
    nodes = [
        NodeActors(
            node_id,
            slot,
            StoreHandle(actor, f"BackendClient[{slot}]@{node_id[:8]}"),
            StoreHandle(found[("ssd", node_id, slot)], f"SsdOffload[{slot}]@{node_id[:8]}")
            if ("ssd", node_id, slot) in found
            else None,
        )
        for (kind, node_id, slot), actor in sorted(found.items(), key=str)
        if kind == "client" and slot is not None
    ]
    lookups = {
        node_id: LookupHandle(actor, f"Lookup@{node_id[:8]}")
        for (kind, node_id, _), actor in found.items()
        if kind == "lookup"
    }
    return nodes, lookups


async def _check_started(
    actors: list[StoreHandle] | list[LookupHandle], node_id: str, config: PoolConfig
) -> None:
    """Wait for every actor; refuse to run if any derives another probe hash."""
    expected = probe_hash()
    for handle in actors:
        try:
            got = await handle.probe().aresult(START_TIMEOUT_S)
        except CallTimeoutError as exc:
            raise BackendUnavailableError(
                f"a pool actor on node {node_id[:12]} did not start in {START_TIMEOUT_S:.0f} "
                f"s: is the node alive, with {config.cpus_per_rank} CPU free (cpus_per_rank)?"
            ) from exc
        except KVRayError as exc:
            raise BackendUnavailableError(
                f"a pool actor on node {node_id[:12]} failed to start: {exc}"
            ) from exc
        if got["probe_hash"] != expected:
            raise HashMismatchError(
                f"an actor on node {node_id[:12]} derives block hash {got['probe_hash']} for "
                f"the probe, the pool manager {expected}: install the same kvray version on "
                "every node"
            )
