"""Starting, attaching to and stopping a pool's Ray actors.

All Ray placement decisions are made here, and this is the only module of the ``kvray``
package that imports the actor shells of ``kvray.actors``.

A pool is cluster-wide: a PoolManager actor (the spec, the registry of the pool's node
actors, and the backend's embedded server when no address is configured:
``mooncake_master``, a datasystem worker with its own metastore, or a MemCache
MetaService) on the node that started it. The pool's clients belong to the nodes that use
it: on each node, per local device/rank ("slot", ``0..world_size-1``), a BackendClient
actor (the backend's client and the memory segment it contributes, "per card") and, with
an ``<backend>|ssd`` pipeline, an SSD offload actor; and one Lookup actor per node for the
schedulers there. They are created on first use from that node (an engine worker
attaching, a Pool API call), by the manager, pinned to the node (hard node affinity):
the KV bytes move through that node's shared memory. Names carry the node id and slot,
so a restarted engine on the same node and device finds the same actor and segment.
Starting is idempotent (``get_if_exists``) and refuses a running pool of the same name
with a different config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvray import engine_env, remote
from kvray.backends.registry import spec_of, with_client_settings
from kvray.config import PoolConfig
from kvray.errors import (
    BackendUnavailableError,
    HashMismatchError,
    KVRayError,
    PoolConflictError,
    PoolNotFoundError,
)
from kvray.keys import probe_hash
from kvray.naming import (
    client_name,
    lookup_name,
    manager_name,
    parse_node_actor,
    placement_group_name,
    region_prefix,
    ssd_name,
)
from kvray.remote import (
    Call,
    CallTimeoutError,
    LookupHandle,
    ManagerHandle,
    StoreHandle,
    ready,
)
from kvray.shm import remove_leftovers

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
_env_warned: set[tuple[str, int]] = set()

# Start-up of one actor is ~2 s on a loaded 2-core machine; setups that take longer
# than this are broken, not slow.
_START_TIMEOUT_S = 120.0


@dataclass
class NodeActors:
    """One slot's actors on one node (what the manager hands out)."""

    node_id: str
    slot: int
    client: StoreHandle
    ssd: StoreHandle | None = None
    env: dict[str, str] = field(default_factory=dict)
    """The engine environment's native backend knobs they were made with
    (:func:`kvray.engine_env.forwarded` of the process whose request made them)."""


@dataclass
class PoolHandles:
    """A process's handles to one running pool: the manager, and the actors of this
    process's own node, fetched (created if need be) on first use."""

    config: PoolConfig
    server_address: str
    embedded: bool
    manager: ManagerHandle
    node_id: str
    """The node this process runs on: its clients live there."""
    _clients: dict[int, NodeActors] = field(default_factory=dict)
    _lookup: LookupHandle | None = None
    forward_env: dict[str, str] = field(default_factory=lambda: engine_env.forwarded(os.environ))
    """The native backend knobs of this process's environment: node actors this process
    makes run with them; ones made with others are reported (:meth:`slot`)."""

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.config.world_size:
            raise ValueError(
                f"rank must be in 0..{self.config.world_size - 1} (the pool's world_size: "
                f"clients per node), got {slot}"
            )

    def slot(self, slot: int) -> NodeActors:
        """Slot ``slot``'s actors on this node (blocking; not for an event loop)."""
        self._check_slot(slot)
        if slot not in self._clients:
            call = self.manager.node_actors(self.node_id, slot, self.forward_env)
            self._clients[slot] = self._checked(call.result(_START_TIMEOUT_S))
        return self._clients[slot]

    async def aslot(self, slot: int) -> NodeActors:
        self._check_slot(slot)
        if slot not in self._clients:
            call = self.manager.node_actors(self.node_id, slot, self.forward_env)
            self._clients[slot] = self._checked(await call.aresult(_START_TIMEOUT_S))
        return self._clients[slot]

    def _checked(self, actors: NodeActors) -> NodeActors:
        assert isinstance(actors, NodeActors), f"manager answered {actors!r}: kvray's bug"
        diffs = engine_env.env_differences(actors.env, self.forward_env)
        if diffs and (self.config.name, actors.slot) not in _env_warned:
            _env_warned.add((self.config.name, actors.slot))
            logger.warning(
                "kvray pool %r: the clients of slot %d on this node were started with other "
                "backend settings than this process's environment, and keep theirs: %s. Fix: "
                "set them alike in every engine's environment, or restart the pool's clients "
                "with these (`kvray down`, then start the engines or `kvray up` with them set)",
                self.config.name,
                actors.slot,
                "; ".join(diffs),
            )
        return actors

    def client(self, slot: int) -> StoreHandle:
        return self.slot(slot).client

    async def aclient(self, slot: int) -> StoreHandle:
        return (await self.aslot(slot)).client

    def known_clients(self) -> list[StoreHandle]:
        """The clients this process has used (no creation)."""
        return [a.client for a in self._clients.values()]

    def lookup(self) -> LookupHandle:
        """This node's Lookup actor (blocking; not for an event loop)."""
        if self._lookup is None:
            call = self.manager.lookup_actor(self.node_id, self.forward_env)
            self._lookup = call.result(_START_TIMEOUT_S)
        return self._lookup

    async def alookup(self) -> LookupHandle:
        if self._lookup is None:
            call = self.manager.lookup_actor(self.node_id, self.forward_env)
            self._lookup = await call.aresult(_START_TIMEOUT_S)
        return self._lookup


def _options(
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


def _on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    # Hard affinity: a client elsewhere could not map the node's shared memory.
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _manager_actor(config: PoolConfig, node_id: str, nodes: int, *, take_back: bool) -> Any:
    """The pool's manager on ``node_id`` (the running one if there is one). Pinned there
    (Ray's soft node affinity placed 6 of 6 test actors on another node of two): Ray
    restarts it there after a crash; when the node is lost, a node actor of the pool on
    another node makes it again on its own (:class:`ManagerLink`)."""
    from kvray.actors.manager import PoolManagerActor

    opts = _options(
        config,
        manager_name(config.name),
        num_cpus=0,
        max_restarts=-1,
        scheduling_strategy=_on_node(node_id),
    )
    return (
        ray.remote(PoolManagerActor)
        .options(**opts)
        .remote(config.model_dump_json(), nodes, take_back)
    )


def launch(config: PoolConfig) -> PoolHandles:
    """Start the pool ``config`` describes, or return the running one of that name; the
    calling node's clients of slots ``0..world_size-1`` are up when this returns."""
    if not ray.is_initialized():
        raise BackendUnavailableError(
            "Ray is not initialized: call ray.init() (or kvray.ray_env.ray_init()) first"
        )
    started = time.monotonic()
    config_json = config.model_dump_json()
    node_id = remote.node_id()
    nodes = len(remote.alive_nodes())
    actor = _manager_actor(config, node_id, nodes, take_back=False)
    manager = ManagerHandle(actor, f"pool {config.name!r} manager")
    try:
        spec = manager.spec().result(_START_TIMEOUT_S)
    except KVRayError as exc:
        remote.kill(actor)
        raise BackendUnavailableError(f"pool manager failed to start: {exc}") from exc
    if spec["config_json"] != config_json:
        raise PoolConflictError(
            f"pool {config.name!r} already runs in namespace {config.namespace!r} with a "
            "different config: attach to it (Pool.attach / kvray status), stop it "
            "(kvray down), or choose another name"
        )
    handles = PoolHandles(config, spec["server_address"], bool(spec["embedded"]), manager, node_id)
    try:
        for slot in range(config.world_size):
            handles.slot(slot)
        handles.lookup()
    except BaseException:
        _teardown(handles)
        raise
    logger.info(
        "kvray pool %r: %d client(s) on node %s, backend %s at %s (%s), ready in %.1f s",
        config.name,
        config.world_size,
        node_id[:12],
        config.backend,
        handles.server_address,
        f"embedded {spec['server_kind']}"
        if spec["embedded"]
        else f"external {spec['server_kind']}",
        time.monotonic() - started,
    )
    return handles


async def create_node_actors(
    config: PoolConfig,
    actor_config_json: str,
    server_address: str,
    node_id: str,
    slot: int,
    env: dict[str, str] | None = None,
) -> NodeActors:
    """Find or create slot ``slot``'s actors on ``node_id`` and wait until they answer
    (called by the pool manager, which owns them); ``env``: the requesting engine's
    native backend knobs, which new actors run with."""
    from kvray.actors.backend_client import BackendClientActor
    from kvray.actors.ssd import SsdOffloadActor

    def node_actor(cls: type, name: str, concurrency: int, *args: Any) -> StoreHandle:
        opts = _options(
            config,
            name,
            env,
            num_cpus=config.cpus_per_rank,
            scheduling_strategy=_on_node(node_id),
            max_restarts=-1,
            max_task_retries=3,
            max_concurrency=concurrency,
        )
        actor: Any = ray.remote(cls).options(**opts).remote(actor_config_json, slot, *args)
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
) -> LookupHandle:
    from kvray.actors.lookup import LookupActor

    opts = _options(
        config,
        lookup_name(config.name, node_id),
        env,
        num_cpus=0,
        scheduling_strategy=_on_node(node_id),
        max_restarts=-1,
        max_task_retries=3,
        max_concurrency=64,
    )
    actor = ray.remote(LookupActor).options(**opts).remote(actor_config_json, server_address)
    handle = LookupHandle(actor, f"Lookup@{node_id[:8]}")
    try:
        await _check_started([handle], node_id, config)
    except BaseException:
        remote.kill(actor)
        raise
    return handle


def actor_config(config: PoolConfig, resolved: dict[str, Any]) -> str:
    """The config the rank actors get: the pool's, with what the embedded server chose
    (MemCache clients need the MetaService's config-store url as well as its url)."""
    return with_client_settings(config, resolved).model_dump_json()


def current_settings(config_json: str, server_address: str) -> tuple[str, str]:
    """A node actor's config and server address: those it was made with, or, when Ray
    restarted it, the manager's current ones (a restarted manager runs its embedded
    server anew, on another node when its own was lost, and restarts the node actors
    that talk to it)."""
    if not remote.restarted():
        return config_json, server_address
    config = PoolConfig.model_validate_json(config_json)
    try:
        actor = remote.find(manager_name(config.name), config.namespace)
        if actor is None:
            raise PoolNotFoundError(f"no manager of pool {config.name!r}")
        spec = ManagerHandle(actor, f"pool {config.name!r} manager").spec().result(_START_TIMEOUT_S)
    except KVRayError as exc:
        logger.warning(
            "pool %s: a restarted actor did not get the pool's current server from the "
            "manager (%s); it keeps %s",
            config.name,
            exc,
            server_address,
        )
        return config_json, server_address
    current = PoolConfig.model_validate_json(spec["config_json"])
    return actor_config(current, spec["resolved"]), str(spec["server_address"])


def find_node_actors(
    config: PoolConfig, alive: set[str]
) -> tuple[list[NodeActors], dict[str, LookupHandle]]:
    """The node actors of pool ``config`` that live on the nodes ``alive``, found by
    their names (what a restarted manager takes back)."""
    found: dict[tuple[str, str, int | None], Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
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


def on_this_node(config: PoolConfig) -> PoolConfig:
    """``config`` with what depends on the node filled in (called inside node actors):
    a Mooncake client advertises the address Ray knows its node by; a datasystem client
    connects to its node's worker (``yuanrong.node_worker_addresses``)."""
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return spec_of(config.backend).on_node(config, node_ip)


async def _check_started(
    actors: list[StoreHandle] | list[LookupHandle], node_id: str, config: PoolConfig
) -> None:
    """Wait for every actor; refuse to run if any derives another probe hash."""
    expected = probe_hash()
    for handle in actors:
        try:
            got = await handle.probe().aresult(_START_TIMEOUT_S)
        except CallTimeoutError as exc:
            raise BackendUnavailableError(
                f"a pool actor on node {node_id[:12]} did not start in {_START_TIMEOUT_S:.0f} "
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


class ManagerLink:
    """A pool actor's calls to its manager (for background work: the ledger): the manager
    is found on first use and again after a failure; a failed call answers None and is
    logged once, with ``consequence``.

    ``recreate`` (the node actors of a detached pool): when the manager is gone for good
    (its node was lost: it is pinned there, so Ray does not restart it elsewhere), make
    it again on this node, from the pool config and start-time node count the manager
    gave when first found. With several such actors, one makes it (``get_if_exists``);
    the new manager takes back the live nodes' actors (PoolManagerActor._take_back)."""

    def __init__(
        self, config: PoolConfig, who: str, consequence: str, *, recreate: bool = False
    ) -> None:
        self._config = config
        self._who = who
        self._consequence = consequence
        self._manager: ManagerHandle | None = None
        self._warned = False
        self._recreate = recreate and config.detached
        self._pool: tuple[str, int] | None = None
        """The pool's own config (JSON) and its node count at start, from the manager."""

    async def _find(self) -> ManagerHandle:
        name, namespace = manager_name(self._config.name), self._config.namespace
        actor = await asyncio.to_thread(remote.find, name, namespace)
        if actor is None:
            if self._pool is None:
                raise PoolNotFoundError(f"no manager of pool {self._config.name!r}")
            pool_json, nodes = self._pool
            logger.warning(
                "kvray %s: the manager of pool %s is gone (its node was lost); making it "
                "again on this node",
                self._who,
                self._config.name,
            )
            config = PoolConfig.model_validate_json(pool_json)
            actor = await asyncio.to_thread(
                _manager_actor, config, remote.node_id(), nodes, take_back=True
            )
        handle = ManagerHandle(actor, f"pool {self._config.name!r} manager")
        if self._recreate and self._pool is None:
            spec = await handle.spec().aresult(self._config.call_timeout_s)
            self._pool = (str(spec["config_json"]), int(spec["nodes_at_start"]))
        return handle

    async def call(self, ask: Callable[[ManagerHandle], Call[_T]]) -> _T | None:
        """``ask(manager)``'s answer, or None (logged once) when it fails."""
        try:
            if self._manager is None:
                self._manager = await self._find()
            call = ask(self._manager)
            return await call.aresult(self._config.call_timeout_s)
        except (ValueError, KVRayError) as exc:
            self._manager = None
            if not self._warned:
                self._warned = True
                logger.warning("kvray %s: a call to the pool manager failed (%s): %s",
                               self._who, exc, self._consequence)  # fmt: skip
            return None


def attach(name: str = "kvray", namespace: str = "kvray", *, clients: bool = True) -> PoolHandles:
    """Handles to the running pool ``name``, for this process's node. ``clients``: this
    process will store or load (refused, naming the fix, when this node cannot reach the
    pool's server); False for status and teardown, which need no client here."""
    actor = remote.find(manager_name(name), namespace)
    if actor is None:
        raise PoolNotFoundError(
            f"no kvray pool {name!r} in Ray namespace {namespace!r}: start one with "
            "`kvray up` or Pool.start()"
        )
    manager = ManagerHandle(actor, f"pool {name!r} manager")
    spec = manager.spec().result(_START_TIMEOUT_S)
    config = PoolConfig.model_validate_json(spec["config_json"])
    node_id = remote.node_id()
    if clients and node_id != spec["node_id"]:
        why = manager.refusal(node_id).result(_START_TIMEOUT_S)
        if why is not None:
            raise BackendUnavailableError(why)
    return PoolHandles(config, spec["server_address"], bool(spec["embedded"]), manager, node_id)


def _teardown(handles: PoolHandles, timeout_s: float = 10.0) -> None:
    """Close and kill every node actor the manager made, stop its server, kill it."""
    try:
        actors = handles.manager.all_actors().result(timeout_s)
    except KVRayError as exc:
        logger.warning("pool manager did not list its actors (%s)", exc)
        actors = []
    closed = ready([a.close() for a in actors], timeout_s, every=True)
    if not all(closed):
        logger.warning(
            "%d pool actor(s) did not close in %.0f s; killing them",
            closed.count(False),
            timeout_s,
        )
    for handle in actors:
        remote.kill(handle.actor)
    try:
        handles.manager.stop().result(timeout_s)
    except KVRayError as exc:
        logger.warning("pool manager did not stop cleanly (%s); killing it", exc)
    remote.kill(handles.manager.actor)
    # Pools of earlier kvray versions placed their ranks in a placement group.
    with contextlib.suppress(ValueError):
        ray.util.remove_placement_group(
            ray.util.get_placement_group(placement_group_name(handles.config.name))
        )
    remove_leftovers(region_prefix(handles.config.name))
    cleanup = spec_of(handles.config.backend).node_cleanup
    if cleanup is not None:
        # Killed actors leave files behind (MemCache: their client conf); give the
        # killed processes a moment to exit first.
        time.sleep(1)
        cleanup()


def shutdown(handles: PoolHandles, timeout_s: float = 10.0) -> None:
    """Close clients, stop the embedded server, kill the actors."""
    _teardown(handles, timeout_s)
    logger.info("kvray pool %r stopped", handles.config.name)
