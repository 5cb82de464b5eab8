"""PoolManager actor: owns a pool's spec, makes and registers the pool's node actors
(each node's clients per slot and its Lookup), and, in embedded mode, runs the backend's
server: a ``mooncake_master``, a datasystem worker with its embedded metastore, or a
MemCache MetaService."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np

from kvray import metrics, remote
from kvray.actors import placement
from kvray.actors.node_config import actor_config
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.errors import BackendUnavailableError, ConfigError, KVRayError
from kvray.index import prefix_match
from kvray.index.kv_events import Described, KVEventsHub
from kvray.index.ledger import Changes
from kvray.index.long_poll import LongPoll
from kvray.index.node_loss import DramClient, NodeLossWatch, SegmentLoss
from kvray.index.prefix_match import PrefixMatch
from kvray.index.stream import IndexChange, IndexHub, IndexUpdate
from kvray.keys import KeySpace
from kvray.naming import manager_name
from kvray.pool_state import GONE_NODE_FORGET_S, PoolState
from kvray.ray_env import normal_priority
from kvray.remote import Handle, LookupHandle, StoreHandle
from kvray.servers.process import ServerProcess, is_loopback
from kvray.servers.supervisor import Supervisor
from kvray.warn_once import WarnOnce

logger = logging.getLogger(__name__)

RECONCILE_S = 15.0


def make_manager(config: PoolConfig, node_id: str, nodes: int, *, take_back: bool) -> Any:
    """The pool's manager on ``node_id`` (the running one if there is one). Pinned there
    (Ray's soft node affinity placed 6 of 6 test actors on another node of two): Ray
    restarts it there after a crash; when the node is lost, a node actor of the pool on
    another node makes it again on its own (:class:`~kvray.remote.ManagerLink`)."""
    opts = placement.options(
        config,
        manager_name(config.name),
        num_cpus=0,
        max_restarts=-1,
        scheduling_strategy=placement.on_node(node_id),
    )
    return placement.spawn(PoolManagerActor, opts, config.model_dump_json(), nodes, take_back)


class _DramAsk:
    """A BackendClient, asked by the node watch through its handle with the pool's call
    timeout."""

    def __init__(self, client: StoreHandle, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s

    def dram_exists(self, keys: list[str]) -> Awaitable[list[bool]]:
        return self._client.dram_exists(keys).aresult(self._timeout_s)

    def reconcile_all(self) -> Awaitable[int]:
        return self._client.reconcile_all().aresult(self._timeout_s)


class PoolManagerActor:
    """One per pool. The embedded server is its child and dies with it; the node actors
    it makes are its own (a non-detached pool's die with it)."""

    def __init__(self, config_json: str, nodes_at_start: int = 1, take_back: bool = False) -> None:
        """``nodes_at_start``: the Ray cluster's alive nodes when the pool was started
        (``server_host: auto`` decides by it, the same way again after a restart);
        ``take_back``: made again after the last manager's node was lost."""
        # The block index's stream and the embedded server (started from this process,
        # it inherits this niceness) are on the stores' and lookups' paths.
        normal_priority("pool manager")
        self._config = config = PoolConfig.model_validate_json(config_json)
        self._config_json = config_json
        self._spec = spec = spec_of(config.backend)
        self._server: ServerProcess | None = None
        self._server_kind = spec.server_name
        self._resolved: dict[str, Any] = {}
        self._node_id = remote.node_id()
        alive = remote.alive_nodes()
        self._node_ip = alive[self._node_id]
        address = config.configured_server
        if address is None:
            host = config.listen_host(self._node_ip, nodes_at_start)
            self._server = spec.make_server(config, host)
            address = self._server.start()
            # What its clients need besides the address (MemCache: the config store's
            # url); the launcher passes it on in the rank actors' config.
            self._resolved = self._server.client_settings()
        self._address = address
        self._started_at = time.time()
        self._actor_config_json = actor_config(config, self._resolved)
        self._state = PoolState(config.name)
        self._making: dict[Any, asyncio.Lock] = {}
        self._supervisor = Supervisor(self._server, config.name) if self._server else None
        self._tasks: list[asyncio.Task[None]] = []
        self._server_metrics: dict[str, float] = {}
        self._index = IndexHub(config.lookup_index_blocks) if config.lookup_index else None
        self._ledger_poll = LongPoll()
        self._nodes_at_start = nodes_at_start
        self._events = self._start_events(alive)
        self._node_watch = self._make_node_watch()
        self._segment_pass: asyncio.Task[None] | None = None
        self._segment_why: str | None = None
        self._stopping = False
        """Set by :meth:`quiesce`: the pool is being torn down."""
        if take_back or remote.restarted():
            self._take_back(set(alive))

    def _start_events(self, alive: dict[str, str]) -> KVEventsHub | None:
        """The KV-events publisher (``kv_events``), listening by ``server_host``'s rule."""
        ev = self._config.kv_events
        if ev is None or self._index is None:
            return None
        host = self._config.listen_host(self._node_ip, self._nodes_at_start, ev.host)
        pub = f"tcp://{host}:{ev.port}"
        replay = None if ev.replay_port is None else f"tcp://{host}:{ev.replay_port}"
        try:
            hub = KVEventsHub(
                self._index.index,
                self._config.name,
                pub,
                replay,
                buffer=ev.buffer_batches,
                hwm=ev.hwm,
                max_blocks=ev.max_blocks,
                node_name=lambda node_id: alive.get(node_id, node_id[:12]),
            )
        except Exception as exc:
            raise ConfigError(
                f"pool {self._config.name!r}: kv_events cannot listen on {pub}"
                f"{'' if replay is None else ' and ' + replay}: {exc}. Fix: another "
                "kv_events.port / replay_port (0: any free port), or stop what holds them"
            ) from exc
        logger.info("pool %s: KV events on %s (replay %s)", self._config.name, pub, replay)
        return hub

    def _make_node_watch(self) -> NodeLossWatch | None:
        """The block index's watch for lost nodes (None: no index), on Ray's alive nodes
        and this manager's clients."""
        if self._index is None:
            return None
        timeout_s = self._config.call_timeout_s

        def clients() -> list[tuple[str, DramClient]]:
            nodes = sorted(self._state.nodes.items())
            return [(node, _DramAsk(a.client, timeout_s)) for (node, _), a in nodes]

        async def alive() -> dict[str, str]:
            return await asyncio.to_thread(remote.alive_nodes)

        return NodeLossWatch(self._config.name, self._index, self._events, alive, clients)

    def _take_back(self, alive: set[str]) -> None:
        """After a restart (Ray restarts the manager when it dies on a live node), or
        made again on another node by a node actor after its node was lost: take back
        the node actors the last manager made, found by name, and, with an embedded
        server (run anew here, at another address if the node changed; what the last one
        held is gone), restart the clients and Lookup actors, which ask this manager for
        the current server as they start. Engines keep their handles: a restarted client
        maps an engine's region again on its first transfer, and the node channel
        re-attaches."""
        nodes, lookups = placement.find_node_actors(self._config, alive)
        for actors in nodes:
            self._state.nodes[(actors.node_id, actors.slot)] = actors
        self._state.lookups.update(lookups)
        if self._server is not None:
            restart = [a.client for a in nodes] + list(lookups.values())
            for handle in restart:
                remote.kill(handle.actor, restart=True)
        logger.warning(
            "pool %s: the manager runs again on node %s (%s); %s at %s; took back %d "
            "client(s) and %d Lookup actor(s)%s",
            self._config.name,
            self._node_id[:12],
            self._node_ip,
            f"the embedded {self._server_kind} runs anew (what it held is gone)"
            if self._server is not None
            else f"the {self._server_kind}",
            self._address,
            len(nodes),
            len(lookups),
            ", restarted to use it" if self._server is not None else "",
        )

    def _ensure_reconciler(self) -> None:
        # Started from the first async call: __init__ runs before the actor's loop does.
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks.append(loop.create_task(self._reconcile()))
            if self._supervisor is not None:
                self._tasks.append(loop.create_task(self._supervisor.run()))
            if self._node_watch is not None:
                self._tasks.append(loop.create_task(self._node_watch.run()))
            url = self._server.scrape_url() if self._server is not None else None
            if url is not None:
                self._tasks.append(loop.create_task(self._export_server(url)))

    async def _export_server(self, url: str) -> None:
        """The embedded server's own view (the master's capacity, used, keys, evictions)
        as the pool's metrics, and for ``kvray status``."""
        exporter, warn = None, WarnOnce(logger)
        segments = SegmentLoss()
        while True:
            try:
                values = await asyncio.to_thread(metrics.scrape, url)
                self._server_metrics = {k: v for k, v in values.items() if k in metrics.SERVER_KEYS}
                why = segments.seen(values)
                if why is not None and self._node_watch is not None and not self._stopping:
                    self._segment_lost(why)
                if exporter is None:
                    exporter = metrics.StatsExporter(self._config.name, "manager", self._node_id)
                exporter.export_server(self._server_metrics)
            except Exception as exc:  # metrics never fail the pool
                warn(
                    "scrape",
                    "pool %s: reading the %s's metrics at %s failed (%s)",
                    self._config.name,
                    self._server_kind,
                    url,
                    exc,
                )
            # Read every second where the block indexes need its eviction counter.
            await asyncio.sleep(1.0 if self._index is not None else metrics.EXPORT_S)

    def _segment_lost(self, why: str) -> None:
        """Reconcile the block index with a segment the server let go
        (:meth:`NodeLossWatch.segment_lost`), one pass at a time: a loss seen during one
        is reconciled by another pass after it."""
        self._segment_why = why
        if self._segment_pass is not None and not self._segment_pass.done():
            return

        async def passes() -> None:
            assert self._node_watch is not None
            while self._segment_why is not None:
                why, self._segment_why = self._segment_why, None
                try:
                    await self._node_watch.segment_lost(why)
                except Exception:
                    name = self._config.name
                    logger.exception("pool %s: reconciling a lost segment failed", name)

        self._segment_pass = asyncio.get_running_loop().create_task(passes())

    async def server_metrics(self) -> dict[str, float]:
        """The embedded server's latest own counters (empty: none, or not read yet)."""
        self._ensure_reconciler()
        return dict(self._server_metrics)

    async def _reconcile(self) -> None:
        """Reconcile loop: forget the actors of nodes dead for GONE_NODE_FORGET_S."""
        while True:
            await asyncio.sleep(RECONCILE_S)
            try:
                await self._forget_gone_nodes(GONE_NODE_FORGET_S)
            except Exception:
                logger.exception("pool %s: reconcile pass failed", self._config.name)

    async def _forget_gone_nodes(self, after_s: float) -> list[str]:
        """Drop the actors of nodes Ray has reported dead for ``after_s``; returns them."""
        alive = await asyncio.to_thread(remote.alive_nodes)
        return self._state.forget_gone(set(alive), after_s, time.monotonic())

    async def _check_node(self, node_id: str) -> None:
        spec = self._spec
        # An embedded server that serves its own node only (the datasystem worker: its
        # node's shared memory) cannot take clients elsewhere.
        fix = spec.node_local_fix
        if fix is not None and self._server is not None and node_id != self._node_id:
            raise BackendUnavailableError(
                f"pool {self._config.name!r} runs an embedded {spec.server_name} on node "
                f"{self._node_id[:12]}, which cannot serve node {node_id[:12]}: {fix}"
            )
        per_node = spec.per_node_server(self._config)
        if node_id == self._node_id and not per_node:
            return
        ip = (await asyncio.to_thread(remote.alive_nodes)).get(node_id)
        if ip is None:
            return
        if per_node:
            spec.on_node(self._config, ip)  # ConfigError if it has no server
        elif ip != self._node_ip and is_loopback(self._address):
            # (Two Ray nodes with one address share a host, and its loopback.)
            raise BackendUnavailableError(self._loopback_refusal(ip))

    def _loopback_refusal(self, ip: str) -> str:
        """Why a client on the node Ray knows as ``ip`` cannot use this pool's server."""
        config, kind = self._config, self._server_kind
        where = f"{kind} at {self._address}, a loopback address of node {self._node_ip}"
        if self._server is None:
            field = ", ".join(f for f, _ in self._spec.reachability(config)) or "its address"
            return (
                f"pool {config.name!r} uses the {where}: on node {ip} that address is the "
                f"node itself, not the server. Give {field} an address every node reaches"
            )
        why = (
            "server_host: auto chose loopback because the Ray cluster had one node when "
            "the pool started"
            if config.server_host == "auto"
            else f"server_host: {config.server_host}"
        )
        return (
            f"pool {config.name!r} runs its embedded {where} ({why}), which node {ip} "
            f"cannot reach. Restart the pool with server_host: node (kvray down "
            f"{config.name}, then kvray up with it in the config) for clients on every node"
        )

    async def refusal(self, node_id: str) -> str | None:
        """Why clients on ``node_id`` cannot use the pool's server (None: they can); an
        attach from that node is refused with it."""
        try:
            await self._check_node(node_id)
        except KVRayError as exc:
            return str(exc)
        return None

    async def node_actors(
        self, node_id: str, slot: int, env: dict[str, str] | None = None
    ) -> remote.NodeActors:
        """Slot ``slot``'s actors on ``node_id``, made on first request (idempotent), with
        the requesting engine's native backend knobs ``env`` (those made earlier keep
        theirs: the answer says which, for the engine to compare)."""
        self._ensure_reconciler()
        await self._check_node(node_id)
        key, nodes = (node_id, slot), self._state.nodes
        async with self._making.setdefault(key, asyncio.Lock()):
            if key not in nodes:
                nodes[key] = await placement.create_node_actors(
                    self._config, self._actor_config_json, self._address, node_id, slot, env,
                    make_manager,
                )  # fmt: skip
        return nodes[key]

    async def lookup_actor(self, node_id: str, env: dict[str, str] | None = None) -> LookupHandle:
        """``node_id``'s Lookup actor, made on first request (idempotent)."""
        await self._check_node(node_id)
        lookups = self._state.lookups
        async with self._making.setdefault(node_id, asyncio.Lock()):
            if node_id not in lookups:
                lookups[node_id] = await placement.create_lookup_actor(
                    self._config, self._actor_config_json, self._address, node_id, env,
                    make_manager,
                )  # fmt: skip
        return lookups[node_id]

    async def nodes(self) -> list[remote.NodeActors]:
        """Every node actor made so far, by node then slot."""
        return self._state.sorted_nodes()

    async def lookups(self) -> dict[str, LookupHandle]:
        return dict(self._state.lookups)

    async def all_actors(self) -> list[Handle]:
        """Every actor this manager made (for shutdown)."""
        return self._state.all_actors()

    async def register_fingerprint(
        self, keys: str, fp: dict[str, Any], engine: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        return self._state.register_fingerprint(keys, fp, engine)

    async def reset_generation(self, keys: str, mine: int) -> int:
        return self._state.reset_generation(keys, mine)

    async def ledger_record(self, changes: Changes) -> None:
        """A BackendClient's blocks stored and removed since its last report."""
        self._state.ledger.record(changes)
        self._ledger_poll.changed()

    async def ledger_since(
        self, seq: int, wait_s: float = 0.0
    ) -> tuple[int, Changes, bool, list[str]]:
        """A Lookup actor's ledger update after ``seq``, long-polling: answered once the
        ledger has changes after ``seq`` (or must be sent whole) or ``wait_s`` passed.
        (Which keys instances hash differently, rare, comes with the next answer.)"""
        ledger = self._state.ledger
        await self._ledger_poll.wait(lambda: seq != ledger.seq, wait_s)
        return self._state.ledger_since(seq)

    async def index_record(self, changes: list[IndexChange]) -> int | None:
        """A BackendClient's stores and removes per tier, for the nodes' block indexes;
        answers the embedded server's eviction counter (the clients reconcile what they
        stored when it moves; None: not known)."""
        self._ensure_reconciler()
        if self._index is not None:
            self._index.record(changes)
            if self._events is not None:
                self._events.changed([np.frombuffer(c.digests, dtype="<u8") for c in changes])
        evicted = self._server_metrics.get("master_evicted_key_count")
        return None if evicted is None else int(evicted)

    async def describe_blocks(self, reports: list[Described]) -> None:
        """A scheduler's saved blocks, described for the pool's KV events."""
        if self._events is not None:
            self._events.describe(reports)

    async def kv_events(self) -> dict[str, str | None] | None:
        """The KV-events sockets, once the publisher runs (None: no ``kv_events``)."""
        if self._events is None:
            return None
        try:
            await asyncio.to_thread(self._events.publisher.wait_ready, 300)
        except ImportError as exc:
            raise ConfigError(
                f"pool {self._config.name!r}: kv_events publishes with vLLM's own event "
                f"types, and vLLM does not import where the pool's manager runs ({exc}): "
                "install vllm there, or remove kv_events"
            ) from exc
        return self._events.endpoints()

    async def prefix_match(self, space: KeySpace, block_hashes: list[bytes]) -> PrefixMatch:
        if self._index is None:
            raise ConfigError(
                f"pool {self._config.name!r} keeps no block index (lookup_index: false), "
                "which prefix_match answers from: start it with lookup_index: true (the "
                "default)"
            )
        alive = await asyncio.to_thread(remote.alive_nodes)
        ours = {node for node, _ in self._state.nodes}
        addresses = {node: ip for node, ip in alive.items() if node in ours}
        return prefix_match.match(self._index.index, space, block_hashes, addresses)

    async def index_since(
        self, epoch: str, seq: int, wait_s: float, node: str = ""
    ) -> IndexUpdate | None:
        """The index keeper of ``node``, long-polling for what came after ``seq``."""
        if self._index is None:
            return None
        return await self._index.wait(epoch, seq, wait_s, node)

    async def fingerprints(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self._state.fingerprints

    async def engines(self) -> list[dict[str, Any]]:
        return self._state.engine_list()

    async def spec(self) -> remote.PoolSpec:
        self._ensure_reconciler()
        server = self._server
        return remote.PoolSpec(
            self._config_json,
            self._address,
            self._server_kind,
            server is not None,
            server.pid if server else None,
            server.alive() if server else None,
            self._supervisor.restarts if self._supervisor else 0,
            self._started_at,
            self._node_id,
            self._node_ip,
            self._resolved,
            self._nodes_at_start,
        )

    async def quiesce(self) -> None:
        """The pool is being torn down: its clients close next, and the segments they let
        go are no loss to reconcile."""
        self._stopping = True
        if self._segment_pass is not None:
            self._segment_pass.cancel()

    async def stop(self) -> None:
        self._stopping = True
        if self._node_watch is not None:
            self._node_watch.close()
        if self._events is not None:
            await asyncio.to_thread(self._events.close)
        if self._supervisor is not None:
            self._supervisor.stop()
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
