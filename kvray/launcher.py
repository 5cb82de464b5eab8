"""A driver's side of a pool: starting it, attaching to it and stopping it, and the
handles a process holds (:class:`PoolHandles`). The only module of kvray's cores that
imports the actor shells of ``kvray.actors`` (to make the manager at ``kvray up``);
where the actors are placed is :mod:`kvray.actors.placement`.

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

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import ray

from kvray import engine_env, remote
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.errors import (
    BackendUnavailableError,
    KVRayError,
    PoolConflictError,
    PoolNotFoundError,
)
from kvray.naming import (
    manager_name,
    placement_group_name,
    region_prefix,
)
from kvray.remote import (
    START_TIMEOUT_S,
    LookupHandle,
    ManagerHandle,
    NodeActors,
    StoreHandle,
    ready,
)
from kvray.shm import remove_leftovers
from kvray.warn_once import WarnOnce

logger = logging.getLogger(__name__)
_env_warn = WarnOnce(logger)


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

    def node_ip(self) -> str:
        """The address Ray knows this process's node by."""
        return remote.node_ip()

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
            self._clients[slot] = self._checked(call.result(START_TIMEOUT_S))
        return self._clients[slot]

    async def aslot(self, slot: int) -> NodeActors:
        self._check_slot(slot)
        if slot not in self._clients:
            call = self.manager.node_actors(self.node_id, slot, self.forward_env)
            self._clients[slot] = self._checked(await call.aresult(START_TIMEOUT_S))
        return self._clients[slot]

    def _checked(self, actors: NodeActors) -> NodeActors:
        assert isinstance(actors, NodeActors), f"manager answered {actors!r}: kvray's bug"
        diffs = engine_env.env_differences(actors.env, self.forward_env)
        if diffs:
            _env_warn(
                (self.config.name, actors.slot),
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
            self._lookup = call.result(START_TIMEOUT_S)
        return self._lookup

    async def alookup(self) -> LookupHandle:
        if self._lookup is None:
            call = self.manager.lookup_actor(self.node_id, self.forward_env)
            self._lookup = await call.aresult(START_TIMEOUT_S)
        return self._lookup


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
    from kvray.actors.manager import make_manager  # (the actors: only at launch)

    actor = make_manager(config, node_id, nodes, take_back=False)
    manager = ManagerHandle(actor, f"pool {config.name!r} manager")
    try:
        spec = manager.spec().result(START_TIMEOUT_S)
    except KVRayError as exc:
        remote.kill(actor)
        raise BackendUnavailableError(f"pool manager failed to start: {exc}") from exc
    if spec.config_json != config_json:
        raise PoolConflictError(
            f"pool {config.name!r} already runs in namespace {config.namespace!r} with a "
            "different config: attach to it (Pool.attach / kvray status), stop it "
            "(kvray down), or choose another name"
        )
    handles = PoolHandles(config, spec.server_address, spec.embedded, manager, node_id)
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
        f"{'embedded' if spec.embedded else 'external'} {spec.server_kind}",
        time.monotonic() - started,
    )
    return handles


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
    spec = manager.spec().result(START_TIMEOUT_S)
    config = PoolConfig.model_validate_json(spec.config_json)
    node_id = remote.node_id()
    if clients and node_id != spec.node_id:
        why = manager.refusal(node_id).result(START_TIMEOUT_S)
        if why is not None:
            raise BackendUnavailableError(why)
    return PoolHandles(config, spec.server_address, spec.embedded, manager, node_id)


def _teardown(handles: PoolHandles, timeout_s: float = 10.0) -> None:
    """Close and kill every node actor the manager made, stop its server, kill it."""
    try:
        handles.manager.quiesce().result(timeout_s)
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
    spec_of(handles.config.backend).node_cleanup()


def shutdown(handles: PoolHandles, timeout_s: float = 10.0) -> None:
    """Close clients, stop the embedded server, kill the actors."""
    _teardown(handles, timeout_s)
    logger.info("kvray pool %r stopped", handles.config.name)
