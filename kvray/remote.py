"""kvray's Ray boundary: typed handles to the pool's actors, the calls in flight to them,
their timeouts, and the one mapping of Ray's errors to kvray's.

Every ``.remote()`` on a pool actor is made here (actor *creation* is the launcher's).
Callers get a :class:`Call` and choose how to wait for it: :meth:`Call.result` from
vLLM's threads and the CLI, ``await call.aresult(...)`` inside actors and the Pool's
loop, :func:`ready` to poll without blocking an engine step. Whatever goes wrong
comes out as a :class:`~kvray.errors.KVRayError`:

- no answer within the caller's timeout -> :class:`CallTimeoutError`;
- the actor (or its node) is gone -> :class:`~kvray.errors.BackendUnavailableError`;
- the actor raised a kvray error -> that error (``RayTaskError.cause``);
- the actor raised anything else (kvray's bug, or its creation failed)
  -> :class:`~kvray.errors.BackendUnavailableError` with the line that names it.

A handle is a small picklable object around a Ray actor handle: the manager hands
them out inside :class:`NodeActors`, and Ray carries them like the
actor handles they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray

from kvray.config import PoolConfig
from kvray.errors import BackendUnavailableError, KVRayError, PoolNotFoundError
from kvray.naming import manager_name
from kvray.warn_once import WarnOnce

if TYPE_CHECKING:
    from kvray.backends.base import KeyStatus
    from kvray.index.block_index import IndexSpec
    from kvray.index.kv_events import Described
    from kvray.index.ledger import Changes
    from kvray.index.lookup import Answer, Placement
    from kvray.index.prefix_match import PrefixMatch
    from kvray.index.stream import IndexChange, IndexUpdate
    from kvray.keys import KeySpace
    from kvray.shm import RegionSpec
    from kvray.transfer import TransferBatch

T = TypeVar("T")
logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Start-up of one actor is ~2 s on a loaded 2-core machine; setups that take longer than
this are broken, not slow."""

Remake = Callable[..., Any]
"""``remake(config, node_id, nodes, take_back=True)``: the pool's manager made again on
``node_id`` (:func:`kvray.actors.manager.make_manager`)."""


class CallTimeoutError(BackendUnavailableError):
    """A pool actor did not answer within the caller's timeout (it may still be busy)."""


def actor_error_line(exc: BaseException) -> str:
    """The line of an actor's failure that names the exception (Ray's text is a page)."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        if "Error" in line and ":" in line:
            return line.strip()
    return text.strip().splitlines()[-1] if text.strip() else repr(exc)


def as_kvray_error(
    exc: BaseException, what: str, timeout_s: float | None, setting: str | None = None
) -> KVRayError:
    """``exc`` (from Ray, or a timeout) as the kvray error a caller of ``what`` sees;
    ``setting``: the config field that sets the timeout, named in the message."""
    if isinstance(exc, ray.exceptions.GetTimeoutError | TimeoutError):
        limit = "its timeout" if timeout_s is None else f"{timeout_s:g} s"
        fix = f" ({setting}={timeout_s:g})" if setting and timeout_s is not None else ""
        return CallTimeoutError(f"{what}: no answer in {limit}{fix}")
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, KVRayError):
            return cause
        return BackendUnavailableError(f"{what}: {actor_error_line(exc)}")
    if isinstance(exc, ray.exceptions.RayActorError):
        return BackendUnavailableError(f"{what}: pool actor unavailable: {actor_error_line(exc)}")
    if isinstance(exc, KVRayError):
        return exc
    return BackendUnavailableError(f"{what}: {type(exc).__name__}: {exc}")


_RAY_FAILURES = (ray.exceptions.RayError, TimeoutError)


class Call(Generic[T]):
    """One call in flight to a pool actor; ``what`` names it in errors."""

    __slots__ = ("ref", "what")

    def __init__(self, ref: Any, what: str) -> None:
        self.ref = ref
        self.what = what

    def done(self) -> bool:
        """Answered (or failed) already; never blocks."""
        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self, timeout_s: float | None, setting: str | None = None) -> T:
        """Block this thread for the answer (``None``: no limit). Not inside an actor.
        ``setting``: the config field ``timeout_s`` comes from (named in a timeout)."""
        try:
            value: T = ray.get(self.ref, timeout=timeout_s)
        except _RAY_FAILURES as exc:
            raise as_kvray_error(exc, self.what, timeout_s, setting) from exc
        return value

    async def aresult(self, timeout_s: float | None, setting: str | None = None) -> T:
        """Await the answer (``None``: no limit), in an actor or on an event loop."""
        try:
            value: T = await asyncio.wait_for(self._awaitable(), timeout_s)
        except _RAY_FAILURES as exc:
            raise as_kvray_error(exc, self.what, timeout_s, setting) from exc
        return value

    async def _awaitable(self) -> T:
        value: T = await self.ref
        return value

    def cancel(self) -> None:
        """Ask Ray to drop the call (an async actor method is cancelled, the answer lost)."""
        ray.cancel(self.ref)

    @property
    def carrier(self) -> object:
        """What carries the call: Ray (None), or a node channel (:mod:`kvray.store.channel`)."""
        return None

    @property
    def served_s(self) -> float | None:
        """Seconds the actor spent serving the call, where its carrier reports it (the
        node channel does; Ray: None)."""
        return None

    def block(self, timeout_s: float | None) -> None:
        """Wait up to ``timeout_s`` for this call (another of its carrier's may answer
        first)."""
        ray.wait([self.ref], timeout=timeout_s)


def node_id() -> str:
    """The Ray node this process runs on."""
    return str(ray.get_runtime_context().get_node_id())


def node_ip() -> str:
    """The address Ray knows this process's node by."""
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def named_actors() -> list[dict[str, str]]:
    """Every named actor of the cluster: its ``name`` and ``namespace``."""
    return list(ray.util.list_named_actors(all_namespaces=True))


def nodes() -> dict[str, tuple[str, bool]]:
    """Every node the Ray cluster knows, by node id: (the address Ray knows it by, alive)."""
    cluster: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return {n["NodeID"]: (n["NodeManagerAddress"], bool(n["Alive"])) for n in cluster}


def alive_nodes() -> dict[str, str]:
    """The cluster's alive nodes: node id -> the address Ray knows it by."""
    return {node: address for node, (address, alive) in nodes().items() if alive}


def find(name: str, namespace: str) -> Any | None:
    """The actor named ``name`` in ``namespace``, or None: there is none (yet)."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def local_clusters(any_gcs: bool = False) -> list[str]:
    """Addresses of the Ray clusters of this machine: the one ``ray start`` recorded and,
    with ``any_gcs``, every running GCS (as Ray's own ``address="auto"`` finds them).
    Ray has no public call for this: these are Ray 2.60's private helpers, pinned by
    tests/unit/test_remote.py; none are found if they moved."""
    try:
        from ray._private.services import find_gcs_addresses
        from ray._private.utils import read_ray_address

        found = [read_ray_address()]
        if any_gcs:
            found += sorted(find_gcs_addresses())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - Ray's private helpers moved: nothing found
        return []
    return [str(a) for a in found if a]


def restarted() -> bool:
    """Inside an actor: Ray made it again after it died (its constructor runs anew)."""
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def kill(actor: Any, *, restart: bool = False) -> None:
    """End ``actor`` (``restart``: for Ray to make it again); one already gone is fine."""
    with contextlib.suppress(ray.exceptions.RayError):
        ray.kill(actor, no_restart=not restart)


def connected() -> bool:
    """This process is connected to a Ray cluster (False before ``ray.init`` and once
    Ray's own atexit shutdown ran: a call then would start a new session)."""
    return bool(ray.is_initialized())


def ready(calls: Sequence[Call[Any]], timeout_s: float = 0, *, every: bool = False) -> list[bool]:
    """Which of ``calls`` have answered, waiting up to ``timeout_s`` for the first (or,
    with ``every``, for all) of them."""
    if not calls:
        return []
    if any(c.ref is None for c in calls):
        return _ready_carried(calls, timeout_s, every)
    refs = [c.ref for c in calls]
    done, _ = ray.wait(refs, num_returns=len(refs) if every else 1, timeout=timeout_s)
    if not every and done and len(refs) > 1:  # which others answered by now, no waiting
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    got = set(done)
    return [r in got for r in refs]


def _done(calls: Sequence[Call[Any]]) -> list[bool]:
    refs = [c.ref for c in calls if c.ref is not None]
    got = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
    return [c.done() if c.ref is None else c.ref in got for c in calls]


def _ready_carried(calls: Sequence[Call[Any]], timeout_s: float, every: bool) -> list[bool]:
    """:func:`ready` where some calls go over a node channel: one carrier is waited on in
    the kernel; calls of several carriers (a channel and Ray while it re-attaches) are
    polled every millisecond."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = _done(calls)
        if all(done) if every else any(done):
            return done
        left = deadline - time.monotonic()
        if left <= 0:
            return done
        waiting = [c for c, d in zip(calls, done, strict=True) if not d]
        one_carrier = len({id(c.carrier) for c in waiting}) == 1
        waiting[0].block(left if one_carrier else min(left, 0.001))


def results(
    calls: Sequence[Call[T]], timeout_s: float | None, setting: str | None = None
) -> list[T]:
    """Block for the answers of ``calls`` together (one deadline for all)."""
    if not calls:
        return []
    if any(c.ref is None for c in calls):
        end = None if timeout_s is None else time.monotonic() + timeout_s
        return [
            c.result(None if end is None else max(0.0, end - time.monotonic()), setting)
            for c in calls
        ]
    try:
        values: list[T] = ray.get([c.ref for c in calls], timeout=timeout_s)
    except _RAY_FAILURES as exc:
        what = calls[0].what if len(calls) == 1 else f"{calls[0].what} (+{len(calls) - 1})"
        raise as_kvray_error(exc, what, timeout_s, setting) from exc
    return values


class Handle:
    """A pool actor handle and the name its calls carry in errors."""

    __slots__ = ("actor", "name")

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name

    def _call(self, method: str, *args: Any) -> Call[Any]:
        return Call(getattr(self.actor, method).remote(*args), f"{self.name}.{method}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.actor == self.actor

    def __hash__(self) -> int:
        return hash(self.actor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (type(self), (self.actor, self.name))

    def close(self) -> Call[None]:
        """Release what the actor holds (before it is killed)."""
        return self._call("close")


class StoreHandle(Handle):
    """A BackendClient actor, or the SSD offload actor below it: one rank's store."""

    __slots__ = ()

    def put(self, batch: TransferBatch, overwrite: bool = False) -> Call[list[KeyStatus]]:
        return Call(self.actor.put.remote(batch, overwrite), f"{self.name}.put of {len(batch)}")

    def get(self, batch: TransferBatch) -> Call[list[KeyStatus]]:
        return Call(self.actor.get.remote(batch), f"{self.name}.get of {len(batch)}")

    def exists(self, keys: Sequence[str]) -> Call[list[bool]]:
        return self._call("exists", list(keys))

    def dram_exists(self, keys: Sequence[str]) -> Call[list[bool]]:
        """The DRAM tier alone (a BackendClient's; the SSD actor has no such call)."""
        return self._call("dram_exists", list(keys))

    def remove(self, keys: Sequence[str], force: bool = False) -> Call[list[KeyStatus]]:
        return self._call("remove", list(keys), force)

    def reconcile_all(self) -> Call[int]:
        """A BackendClient asks the backend about every DRAM key it stored (its eviction
        sweep's next passes) and publishes the gone ones; how many it will ask about."""
        return self._call("reconcile_all")

    def map_region(self, spec: RegionSpec) -> Call[None]:
        return self._call("map_region", spec)

    def release_region(self, region_id: str) -> Call[None]:
        return self._call("release_region", region_id)

    def probe(self) -> Call[dict[str, Any]]:
        return self._call("probe")

    def channel(self) -> Call[str]:
        """The address of the actor's node channel (:mod:`kvray.store.channel`), listening
        from this call on."""
        return self._call("channel")

    def snapshot(self) -> Call[dict[str, Any]]:
        return self._call("snapshot")

    def health(self) -> Call[bool]:
        return self._call("health")

    def connect_keeper(self) -> Call[None]:
        """Connect to the node's block-index keeper (before the first store needs it)."""
        return self._call("connect_keeper")


class LookupHandle(Handle):
    """A node's Lookup actor (one per node and pool)."""

    __slots__ = ()

    def lookup(
        self,
        space: KeySpace,
        block_hashes: Sequence[bytes],
        timeout_s: float,
        want: int = 0,
        wait_s: float = 0.0,
        placement: Placement | None = None,
    ) -> Call[Answer]:
        """Leading blocks present for every rank; ``want``/``wait_s``: a PD decode
        instance waits up to ``wait_s`` for ``want`` blocks its prefill is storing;
        ``placement``: where each rank's worker loads through (the SSD tiers asked; None:
        this node's slot per rank)."""
        return self._call("lookup", space, block_hashes, timeout_s, want, wait_s, placement)

    def probe(self) -> Call[dict[str, Any]]:
        return self._call("probe")

    def snapshot(self) -> Call[dict[str, Any]]:
        return self._call("snapshot")

    def pin(self, space: KeySpace, block_hashes: Sequence[bytes], timeout_s: float) -> Call[None]:
        """Pin every rank's key of ``block_hashes`` until loaded (where the backend has
        leases); never raises (a failed pin is counted)."""
        return self._call("pin", space, block_hashes, timeout_s)

    def report(self, counts: dict[str, int]) -> Call[None]:
        """Lookup counters (``RankStats`` fields) of lookups a scheduler's block index
        answered, added to the actor's."""
        return self._call("report", counts)

    def index_apply(self, changes: list[IndexChange]) -> Call[None]:
        """This node's clients' block-index changes, applied as they make them."""
        return self._call("index_apply", changes)

    def channel(self) -> Call[str]:
        """The address of the node channel the actor takes ``index_apply`` on (its node's
        clients only), listening from this call on."""
        return self._call("channel")

    def index_spec(self) -> Call[IndexSpec | None]:
        """The node's block index, for a scheduler to map (None: the pool keeps none)."""
        return self._call("index_spec")


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


@dataclass(frozen=True)
class PoolSpec:
    """What the manager says of its pool (:meth:`ManagerHandle.spec`)."""

    config_json: str
    server_address: str
    server_kind: str
    embedded: bool
    server_pid: int | None
    """The embedded server's process (None: an external server)."""
    server_alive: bool | None
    server_restarts: int
    started_at: float
    node_id: str
    """The manager's node, and the address Ray knows it by."""
    node_ip: str
    resolved: dict[str, Any]
    """What the embedded server chose that its clients need (``client_settings``)."""
    nodes_at_start: int


class ManagerHandle(Handle):
    """The pool's manager actor (one per pool, named)."""

    __slots__ = ()

    def spec(self) -> Call[PoolSpec]:
        return self._call("spec")

    def node_actors(self, node_id: str, slot: int, env: dict[str, str]) -> Call[NodeActors]:
        return self._call("node_actors", node_id, slot, env)

    def refusal(self, node_id: str) -> Call[str | None]:
        """Why clients on ``node_id`` cannot use the pool's server (None: they can)."""
        return self._call("refusal", node_id)

    def lookup_actor(self, node_id: str, env: dict[str, str]) -> Call[LookupHandle]:
        return self._call("lookup_actor", node_id, env)

    def nodes(self) -> Call[list[NodeActors]]:
        return self._call("nodes")

    def lookups(self) -> Call[dict[str, LookupHandle]]:
        return self._call("lookups")

    def all_actors(self) -> Call[list[Handle]]:
        return self._call("all_actors")

    def register_fingerprint(
        self, keys: str, fp: dict[str, Any], engine: dict[str, Any] | None = None
    ) -> Call[list[dict[str, Any]]]:
        return self._call("register_fingerprint", keys, fp, engine)

    def reset_generation(self, keys: str, mine: int) -> Call[int]:
        """:meth:`kvray.pool_state.PoolState.reset_generation`."""
        return self._call("reset_generation", keys, mine)

    def ledger_record(self, changes: Changes) -> Call[None]:
        return self._call("ledger_record", changes)

    def ledger_since(
        self, seq: int, wait_s: float = 0.0
    ) -> Call[tuple[int, Changes, bool, list[str]]]:
        """The ledger's changes after ``seq``, once there are any or ``wait_s`` passed."""
        return self._call("ledger_since", seq, wait_s)

    def index_record(self, changes: list[IndexChange]) -> Call[int | None]:
        """Block-index changes for the hub; answers the pool server's eviction counter
        (None: not known)."""
        return self._call("index_record", changes)

    def prefix_match(self, space: KeySpace, block_hashes: list[bytes]) -> Call[PrefixMatch]:
        """Leading blocks of ``block_hashes`` the pool holds, per tier and node (from the
        hub's block index: :mod:`kvray.index.prefix_match`)."""
        return self._call("prefix_match", space, block_hashes)

    def describe_blocks(self, reports: list[Described]) -> Call[None]:
        """Saved blocks as a scheduler knew them, for the pool's KV events."""
        return self._call("describe_blocks", reports)

    def kv_events(self) -> Call[dict[str, str | None] | None]:
        """The KV-events sockets (``endpoint``, ``replay``) once the publisher runs; None
        when the pool has no ``kv_events``."""
        return self._call("kv_events")

    def index_since(
        self, epoch: str, seq: int, wait_s: float, node: str = ""
    ) -> Call[IndexUpdate | None]:
        """The block-index changes after ``seq`` of ``epoch`` (or a snapshot) for the
        keeper of ``node`` (its own node's as markers), once there are any from other
        nodes or ``wait_s`` passed; None when the pool keeps no index."""
        return self._call("index_since", epoch, seq, wait_s, node)

    def fingerprints(self) -> Call[dict[str, dict[str, dict[str, Any]]]]:
        return self._call("fingerprints")

    def engines(self) -> Call[list[dict[str, Any]]]:
        return self._call("engines")

    def server_metrics(self) -> Call[dict[str, float]]:
        return self._call("server_metrics")

    def quiesce(self) -> Call[None]:
        """Before the pool's actors close: what they let go is no loss to reconcile."""
        return self._call("quiesce")

    def stop(self) -> Call[None]:
        return self._call("stop")


class ManagerLink:
    """A pool actor's calls to its manager (for background work: the ledger): the manager
    is found on first use and again after a failure; a failed call answers None and is
    logged once, with ``consequence``.

    ``remake`` (the node actors of a detached pool get it from the manager): when the
    manager is gone for good (its node was lost: it is pinned there, so Ray does not
    restart it elsewhere), make it again on this node, from the pool config and
    start-time node count the manager gave when first found. With several such actors,
    one makes it (``get_if_exists``); the new manager takes back the live nodes' actors
    (PoolManagerActor._take_back)."""

    def __init__(
        self, config: PoolConfig, who: str, consequence: str, *, remake: Remake | None = None
    ) -> None:
        self._config = config
        self._who = who
        self._consequence = consequence
        self._manager: ManagerHandle | None = None
        self._warn = WarnOnce(logger)
        self._remake = remake if config.detached else None
        self._pool: tuple[str, int] | None = None
        """The pool's own config (JSON) and its node count at start, from the manager."""

    async def _find(self) -> ManagerHandle:
        name, namespace = manager_name(self._config.name), self._config.namespace
        actor = await asyncio.to_thread(find, name, namespace)
        if actor is None:
            if self._pool is None or self._remake is None:
                raise PoolNotFoundError(f"no manager of pool {self._config.name!r}")
            pool_json, nodes = self._pool
            logger.warning(
                "kvray %s: the manager of pool %s is gone (its node was lost); making it "
                "again on this node",
                self._who,
                self._config.name,
            )
            config = PoolConfig.model_validate_json(pool_json)
            actor = await asyncio.to_thread(self._remake, config, node_id(), nodes, take_back=True)
        handle = ManagerHandle(actor, f"pool {self._config.name!r} manager")
        if self._remake is not None and self._pool is None:
            spec = await handle.spec().aresult(self._config.call_timeout_s)
            self._pool = (spec.config_json, spec.nodes_at_start)
        return handle

    async def call(self, ask: Callable[[ManagerHandle], Call[T]]) -> T | None:
        """``ask(manager)``'s answer, or None (logged once) when it fails."""
        try:
            if self._manager is None:
                self._manager = await self._find()
            call = ask(self._manager)
            return await call.aresult(self._config.call_timeout_s)
        except (ValueError, KVRayError) as exc:
            self._manager = None
            self._warn("call", "kvray %s: a call to the pool manager failed (%s): %s",
                       self._who, exc, self._consequence)  # fmt: skip
            return None
