"""Starting, attaching to and stopping a pool's Ray actors.

All Ray placement decisions are made here, and this is the only module of the ``kvray``
package that imports the actor shells of ``kvray.actors``.

A pool is: a placement group with one bundle per rank, a PoolManager actor (the spec,
and the backend's embedded server when no address is configured: ``mooncake_master``,
or a datasystem worker with its own metastore) and, per
rank, a BackendClient actor and a Lookup actor in that rank's bundle. Every actor is
named and namespaced; starting is idempotent (``get_if_exists``) and refuses a running
pool of the same name with a different config.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvray.config import PoolConfig
from kvray.errors import (
    BackendUnavailableError,
    HashMismatchError,
    PoolConflictError,
    PoolNotFoundError,
)
from kvray.keys import probe_hash
from kvray.naming import (
    backend_name,
    lookup_name,
    manager_name,
    placement_group_name,
    region_prefix,
    ssd_name,
)
from kvray.shm import remove_leftovers

logger = logging.getLogger(__name__)

# Start-up of one actor is ~2 s on a loaded 2-core machine; setups that take longer
# than this are broken, not slow.
_START_TIMEOUT_S = 120.0
_ACTOR_ENV = {
    # Fail a Mooncake setup against an unreachable master in seconds, not ~90 s.
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
}


@dataclass
class PoolHandles:
    """The running actors of one pool."""

    config: PoolConfig
    server_address: str
    embedded: bool
    manager: Any
    backends: list[Any]
    lookups: list[Any]
    ssds: list[Any] = field(default_factory=list)
    """Per-rank SSD offload actors (pipeline ``<backend>|ssd``), else empty."""


def _actor_error(exc: BaseException) -> str:
    """The line of a dead actor's creation error that names kvray's exception."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        if "Error" in line and ":" in line:
            return line.strip()
    return text.strip().splitlines()[-1] if text.strip() else repr(exc)


def _get_placement_group(config: PoolConfig) -> PlacementGroup:
    name = placement_group_name(config.name)
    try:
        existing: PlacementGroup = ray.util.get_placement_group(name)
        return existing
    except ValueError:
        pass
    pg = placement_group(
        [{"CPU": config.cpus_per_rank}] * config.world_size,
        strategy=config.placement_strategy,
        name=name,
        lifetime="detached" if config.detached else None,
    )
    try:
        ray.get(pg.ready(), timeout=_START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as exc:
        remove_placement_group(pg)
        raise BackendUnavailableError(
            f"placement group for {config.world_size} ranks x {config.cpus_per_rank} CPU "
            f"({config.placement_strategy}) could not be placed in {_START_TIMEOUT_S:.0f} s: "
            "the cluster lacks the resources; lower cpus_per_rank or add nodes"
        ) from exc
    created: PlacementGroup = pg
    return created


def _options(config: PoolConfig, name: str, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": config.namespace,
        "get_if_exists": True,
        "lifetime": "detached" if config.detached else None,
        "runtime_env": {"env_vars": {**_ACTOR_ENV, **config.mooncake.offload.env()}},
        **kw,
    }


def launch(config: PoolConfig) -> PoolHandles:
    """Start the pool ``config`` describes, or return the running one of that name."""
    from kvray.actors.backend_client import BackendClientActor
    from kvray.actors.lookup import LookupActor
    from kvray.actors.manager import PoolManagerActor
    from kvray.actors.ssd import SsdOffloadActor

    if not ray.is_initialized():
        raise BackendUnavailableError(
            "Ray is not initialized: call ray.init() (or kvray.ray_env.ray_init()) first"
        )
    started = time.monotonic()
    config_json = config.model_dump_json()
    pg = _get_placement_group(config)
    created: list[Any] = []
    try:
        manager = (
            ray.remote(PoolManagerActor)
            .options(
                **_options(
                    config,
                    manager_name(config.name),
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
                )
            )
            .remote(config_json)
        )
        created.append(manager)
        try:
            spec = ray.get(manager.spec.remote(), timeout=_START_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            raise BackendUnavailableError(
                f"pool manager failed to start: {_actor_error(exc)}"
            ) from exc
        if spec["config_json"] != config_json:
            created.clear()  # not ours to tear down
            raise PoolConflictError(
                f"pool {config.name!r} already runs in namespace {config.namespace!r} with a "
                "different config: attach to it (Pool.attach / kvray status), stop it "
                "(kvray down), or choose another name"
            )
        address = spec["server_address"]
        actor_config_json = _actor_config(config, spec.get("resolved") or {})
        rank_address = [_rank_address(config, rank, address) for rank in range(config.world_size)]
        per_actor_cpu = config.cpus_per_rank / (3 if config.ssd_tier else 2)
        backends, lookups, ssds = [], [], []

        def rank_actor(cls: type, name: str, rank: int, concurrency: int, *args: Any) -> Any:
            """A restartable per-rank actor in the rank's placement-group bundle."""
            opts = _options(
                config,
                name,
                num_cpus=per_actor_cpu,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, rank),
                max_restarts=-1,
                max_task_retries=3,
                max_concurrency=concurrency,
            )
            return ray.remote(cls).options(**opts).remote(actor_config_json, rank, *args)

        for rank in range(config.world_size):
            if config.ssd_tier:
                ssds.append(rank_actor(SsdOffloadActor, ssd_name(config.name, rank), rank, 32))
            address_r = rank_address[rank]
            backends.append(
                rank_actor(BackendClientActor, backend_name(config.name, rank), rank, 32, address_r)
            )
            lookups.append(
                rank_actor(LookupActor, lookup_name(config.name, rank), rank, 64, address_r)
            )
        created += backends + lookups + ssds
        probes = _check_started(backends + lookups + ssds)
        if config.backend == "yuanrong" and spec["embedded"]:
            _check_one_node(spec, probes[: config.world_size])
    except BaseException:
        if created:
            # Stop the embedded server cleanly (its directory goes with it) before the
            # manager is killed; a manager that failed to start has nothing to stop.
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                ray.get(created[0].stop.remote(), timeout=30)
        for actor in created:
            ray.kill(actor, no_restart=True)
        if created:
            remove_placement_group(pg)
        if config.backend == "memcache":
            from kvray.backends.memcache import remove_stale_local_confs

            # Killed actors leave their client conf behind (node-local cleanup); give
            # the killed processes a moment to exit first.
            time.sleep(1)
            remove_stale_local_confs()
        raise
    logger.info(
        "kvray pool %r: %d rank(s), backend %s at %s (%s), ready in %.1f s",
        config.name,
        config.world_size,
        config.backend,
        address,
        f"embedded {spec['server_kind']}"
        if spec["embedded"]
        else f"external {spec['server_kind']}",
        time.monotonic() - started,
    )
    return PoolHandles(config, address, bool(spec["embedded"]), manager, backends, lookups, ssds)


def _actor_config(config: PoolConfig, resolved: dict[str, Any]) -> str:
    """The config the rank actors get: the pool's, with what the embedded server chose
    (MemCache clients need the MetaService's config-store url as well as its url)."""
    if config.backend == "memcache" and resolved:
        memcache = config.memcache.model_copy(update=resolved)
        return config.model_copy(update={"memcache": memcache}).model_dump_json()
    return config.model_dump_json()


def _rank_address(config: PoolConfig, rank: int, server_address: str) -> str:
    """The server rank ``rank``'s clients connect to."""
    if config.backend == "yuanrong":
        return config.yuanrong.address_for(rank) or server_address
    return server_address


def _check_one_node(spec: dict[str, Any], probes: list[dict[str, Any]]) -> None:
    """The embedded datasystem worker serves its own node only (shared memory)."""
    away = [p["rank"] for p in probes if p["node_id"] != spec["node_id"]]
    if away:
        raise BackendUnavailableError(
            f"rank(s) {away} were placed on another node than the pool's embedded datasystem "
            "worker, which serves only its own node: run a worker per node (scripts/"
            "datasystem_cluster.py) and set yuanrong.worker_address / rank_worker_addresses, "
            "or keep the pool on one node (placement_strategy: STRICT_PACK)"
        )


def _check_started(actors: list[Any]) -> list[dict[str, Any]]:
    """Wait for every actor; refuse to run if any derives another probe hash."""
    expected = probe_hash()
    refs = [a.probe.remote() for a in actors]
    probes = []
    for ref in refs:
        try:
            got = ray.get(ref, timeout=_START_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            raise BackendUnavailableError(
                f"a pool actor failed to start: {_actor_error(exc)}"
            ) from exc
        if got["probe_hash"] != expected:
            raise HashMismatchError(
                f"rank {got['rank']} derives block hash {got['probe_hash']} for the probe, this "
                f"process {expected}: install the same kvray version on every node"
            )
        probes.append(got)
    return probes


def attach(name: str = "kvray", namespace: str = "kvray") -> PoolHandles:
    """Handles to the running pool ``name``."""
    try:
        manager = ray.get_actor(manager_name(name), namespace=namespace)
    except ValueError as exc:
        raise PoolNotFoundError(
            f"no kvray pool {name!r} in Ray namespace {namespace!r}: start one with "
            "`kvray up` or Pool.start()"
        ) from exc
    manager_spec: dict[str, Any] = ray.get(manager.spec.remote(), timeout=_START_TIMEOUT_S)  # type: ignore[assignment]  # ray.get overloads on an untyped ref
    config = PoolConfig.model_validate_json(manager_spec["config_json"])
    backends = [
        ray.get_actor(backend_name(name, r), namespace=namespace) for r in range(config.world_size)
    ]
    lookups = [
        ray.get_actor(lookup_name(name, r), namespace=namespace) for r in range(config.world_size)
    ]
    ssds = (
        [ray.get_actor(ssd_name(name, r), namespace=namespace) for r in range(config.world_size)]
        if config.ssd_tier
        else []
    )
    return PoolHandles(
        config,
        manager_spec["server_address"],
        bool(manager_spec["embedded"]),
        manager,
        backends,
        lookups,
        ssds,
    )


def shutdown(handles: PoolHandles, timeout_s: float = 10.0) -> None:
    """Close clients, stop the embedded server, kill the actors, free the bundles."""
    rank_actors = handles.backends + handles.lookups + handles.ssds
    closing = [a.close.remote() for a in rank_actors]
    ready, _ = ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    if len(ready) < len(closing):
        logger.warning(
            "%d pool actor(s) did not close in %.0f s; killing them",
            len(closing) - len(ready),
            timeout_s,
        )
    for actor in rank_actors:
        ray.kill(actor, no_restart=True)
    try:
        ray.get(handles.manager.stop.remote(), timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        logger.warning("pool manager did not stop cleanly (%s); killing it", exc)
    ray.kill(handles.manager, no_restart=True)
    with contextlib.suppress(ValueError):  # already removed
        remove_placement_group(
            ray.util.get_placement_group(placement_group_name(handles.config.name))
        )
    remove_leftovers(region_prefix(handles.config.name))
    if handles.config.backend == "memcache":
        from kvray.backends.memcache import remove_stale_local_confs

        remove_stale_local_confs()
    logger.info("kvray pool %r stopped", handles.config.name)
