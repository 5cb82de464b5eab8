"""PoolManager actor: owns a pool's spec, makes and registers the pool's node actors
(each node's clients per slot and its Lookup), and, in embedded mode, runs the backend's
server: a ``mooncake_master``, a datasystem worker with its embedded metastore, or a
MemCache MetaService."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray

from kvray import launcher, metrics
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.errors import BackendUnavailableError
from kvray.ledger import Entries, Ledger
from kvray.remote import Handle, LookupHandle
from kvray.servers.process import ServerProcess

logger = logging.getLogger(__name__)

GONE_NODE_FORGET_S = 300.0
"""How long a dead node's actors stay listed (``kvray status`` shows them "node gone")
before the manager forgets them; a node that comes back gets new ones (a new node id)."""
RECONCILE_S = 15.0
SUPERVISE_S = 1.0
"""How often the manager checks its embedded server; one that died is restarted on the same
address (the clients reconnect there by themselves; what it held is gone)."""
RESTART_BACKOFF_MAX_S = 30.0


class PoolManagerActor:
    """One per pool. The embedded server is its child and dies with it; the node actors
    it makes are its own (a non-detached pool's die with it)."""

    def __init__(self, config_json: str) -> None:
        self._config = config = PoolConfig.model_validate_json(config_json)
        self._config_json = config_json
        self._spec = spec = spec_of(config.backend)
        self._server: ServerProcess | None = None
        self._server_kind = spec.server_name
        self._resolved: dict[str, Any] = {}
        address = spec.server_address(config)
        if address is None:
            self._server = spec.make_server(config)
            address = self._server.start()
            # What its clients need besides the address (MemCache: the config store's
            # url); the launcher passes it on in the rank actors' config.
            self._resolved = self._server.client_settings()
        self._address = address
        self._started_at = time.time()
        self._node_id = ray.get_runtime_context().get_node_id()
        self._actor_config_json = launcher.actor_config(config, self._resolved)
        self._nodes: dict[tuple[str, int], launcher.NodeActors] = {}
        self._lookups: dict[str, LookupHandle] = {}
        self._geometries: dict[str, str] = {}
        """``namespace@layout`` -> the block geometry its stored bytes have."""
        self._fingerprints: dict[str, dict[str, dict[str, Any]]] = {}
        """``namespace@layout`` -> hash domain -> how its instances hash blocks (vLLM's
        algorithm, the seed's source) and how many registered it."""
        self._ledger = Ledger()
        """The blocks the pool's clients stored and removed (what Lookup actors follow to
        name their misses' reasons)."""
        self._making: dict[Any, asyncio.Lock] = {}
        self._gone_since: dict[str, float] = {}
        self._reconciler: asyncio.Task[None] | None = None
        self._exporter: asyncio.Task[None] | None = None
        self._server_metrics: dict[str, float] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._server_restarts = 0
        self._stopping = False

    def _ensure_reconciler(self) -> None:
        # Started from the first async call: __init__ runs before the actor's loop does.
        if self._reconciler is None:
            loop = asyncio.get_running_loop()
            self._reconciler = loop.create_task(self._reconcile())
            if self._server is not None:
                self._supervisor = loop.create_task(self._supervise(self._server))
            url = self._server.scrape_url() if self._server is not None else None
            if url is not None:
                self._exporter = loop.create_task(self._export_server(url))

    async def _export_server(self, url: str) -> None:
        """The embedded server's own view (the master's capacity, used, keys, evictions)
        as the pool's metrics, and for ``kvray status``."""
        exporter, warned = None, False
        while True:
            try:
                values = await asyncio.to_thread(metrics.scrape, url)
                self._server_metrics = {k: v for k, v in values.items() if k in metrics.SERVER_KEYS}
                if exporter is None:
                    exporter = metrics.StatsExporter(self._config.name, "manager", self._node_id)
                exporter.export_server(self._server_metrics)
            except Exception as exc:  # metrics never fail the pool
                if not warned:
                    warned = True
                    logger.warning(
                        "pool %s: reading the %s's metrics at %s failed (%s)",
                        self._config.name,
                        self._server_kind,
                        url,
                        exc,
                    )
            await asyncio.sleep(metrics.EXPORT_S)

    async def server_metrics(self) -> dict[str, float]:
        """The embedded server's latest own counters (empty: none, or not read yet)."""
        self._ensure_reconciler()
        return dict(self._server_metrics)

    async def _supervise(self, server: ServerProcess) -> None:
        """Restart the embedded server on its address when it dies (crash, OOM kill),
        backing off while restarts fail; the pool's clients reconnect by themselves."""
        name, kind = self._config.name, self._server_kind
        delay = SUPERVISE_S
        while True:
            await asyncio.sleep(delay)
            if self._stopping or server.alive():
                delay = SUPERVISE_S
                continue
            logger.warning(
                "pool %s: the embedded %s (pid %s) died; restarting it on %s (the blocks it "
                "held are gone: they read as misses)",
                name,
                kind,
                server.pid,
                self._address,
            )
            try:
                await asyncio.to_thread(server.restart)
            except Exception as exc:
                delay = min(RESTART_BACKOFF_MAX_S, max(2 * delay, 2.0))
                logger.error(
                    "pool %s: restarting the %s failed (%s); next try in %.0f s",
                    name, kind, exc, delay,
                )  # fmt: skip
                continue
            self._server_restarts += 1
            delay = SUPERVISE_S
            logger.warning(
                "pool %s: the embedded %s is back on %s (pid %s, restart %d)",
                name, kind, self._address, server.pid, self._server_restarts,
            )  # fmt: skip

    async def _reconcile(self) -> None:
        """Reconcile loop: forget the actors of nodes dead for GONE_NODE_FORGET_S."""
        while True:
            await asyncio.sleep(RECONCILE_S)
            try:
                await self.forget_gone_nodes(GONE_NODE_FORGET_S)
            except Exception:
                logger.exception("pool %s: reconcile pass failed", self._config.name)

    async def forget_gone_nodes(self, after_s: float) -> list[str]:
        """Drop the actors of nodes Ray has reported dead for ``after_s``; returns them."""
        cluster = await asyncio.to_thread(ray.nodes)
        alive = {n["NodeID"] for n in cluster if n["Alive"]}
        now = time.monotonic()
        forgotten = []
        for node in {k[0] for k in self._nodes} | set(self._lookups):
            if node in alive:
                self._gone_since.pop(node, None)
                continue
            if now - self._gone_since.setdefault(node, now) < after_s:
                continue
            for key in [k for k in self._nodes if k[0] == node]:
                del self._nodes[key]
            self._lookups.pop(node, None)
            self._gone_since.pop(node, None)
            forgotten.append(node)
            logger.info("pool %s: forgot the actors of node %s (gone)", self._config.name, node)
        return forgotten

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
        if spec.per_node_server(self._config):
            cluster = await asyncio.to_thread(ray.nodes)
            ips = {n["NodeID"]: n["NodeManagerAddress"] for n in cluster}
            if node_id in ips:
                spec.on_node(self._config, ips[node_id])  # ConfigError if it has no server

    async def node_actors(
        self, node_id: str, slot: int, env: dict[str, str] | None = None
    ) -> launcher.NodeActors:
        """Slot ``slot``'s actors on ``node_id``, made on first request (idempotent), with
        the requesting engine's native backend knobs ``env`` (those made earlier keep
        theirs: the answer says which, for the engine to compare)."""
        self._ensure_reconciler()
        await self._check_node(node_id)
        key = (node_id, slot)
        async with self._making.setdefault(key, asyncio.Lock()):
            if key not in self._nodes:
                self._nodes[key] = await launcher.create_node_actors(
                    self._config, self._actor_config_json, self._address, node_id, slot, env
                )
        return self._nodes[key]

    async def lookup_actor(self, node_id: str, env: dict[str, str] | None = None) -> LookupHandle:
        """``node_id``'s Lookup actor, made on first request (idempotent)."""
        await self._check_node(node_id)
        async with self._making.setdefault(node_id, asyncio.Lock()):
            if node_id not in self._lookups:
                self._lookups[node_id] = await launcher.create_lookup_actor(
                    self._config, self._actor_config_json, self._address, node_id, env
                )
        return self._lookups[node_id]

    async def nodes(self) -> list[launcher.NodeActors]:
        """Every node actor made so far, by node then slot."""
        return [self._nodes[k] for k in sorted(self._nodes)]

    async def lookups(self) -> dict[str, LookupHandle]:
        return dict(self._lookups)

    async def all_actors(self) -> list[Handle]:
        """Every actor this manager made (for shutdown)."""
        actors: list[Handle] = [a.client for a in self._nodes.values()]
        actors += [a.ssd for a in self._nodes.values() if a.ssd is not None]
        return actors + list(self._lookups.values())

    async def claim_geometry(self, keys: str, geometry: str) -> str:
        """The block geometry of keys ``keys`` (``namespace@layout``): the first engine's
        claim stands; an engine comparing its own with the answer never writes bytes of
        another shape under the same keys."""
        return self._geometries.setdefault(keys, geometry)

    async def register_fingerprint(self, keys: str, fp: dict[str, Any]) -> list[dict[str, Any]]:
        """An attaching instance's hash fingerprint for keys ``keys`` (``namespace@layout``);
        answers the other hash domains seen for the same keys (empty: all hash alike)."""
        seen = self._fingerprints.setdefault(keys, {})
        entry = seen.setdefault(fp["hash_domain"], {**fp, "instances": 0})
        entry["instances"] += 1
        entry["last_seen"] = time.time()
        return [dict(v) for d, v in seen.items() if d != fp["hash_domain"]]

    async def ledger_record(self, changes: Entries) -> None:
        """A BackendClient's blocks stored and removed since its last report."""
        self._ledger.record(changes)

    async def ledger_since(self, seq: int) -> tuple[int, Entries, bool, list[str]]:
        """A Lookup actor's update: the ledger's changes after ``seq`` (or all of it), and
        the ``namespace@layout`` that instances hashing blocks differently share."""
        new_seq, entries, full = self._ledger.since(seq)
        mixed = [k for k, domains in self._fingerprints.items() if len(domains) > 1]
        return new_seq, entries, full, mixed

    async def fingerprints(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self._fingerprints

    async def spec(self) -> dict[str, Any]:
        self._ensure_reconciler()
        return {
            "config_json": self._config_json,
            "server_address": self._address,
            "server_kind": self._server_kind,
            "embedded": self._server is not None,
            "server_pid": self._server.pid if self._server else None,
            "server_alive": self._server.alive() if self._server else None,
            "server_restarts": self._server_restarts,
            "started_at": self._started_at,
            "node_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "resolved": self._resolved,
        }

    async def stop(self) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
