"""What a pool's manager remembers, without Ray: the node actors it made, the hash
fingerprints and load-failure policies engines registered, and the ledger of stored and removed
blocks. The PoolManager actor (``actors/manager.py``) is a thin shell around it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvray.index.ledger import Changes, Ledger

if TYPE_CHECKING:
    from collections.abc import Collection

    from kvray.remote import Handle, LookupHandle, NodeActors

logger = logging.getLogger(__name__)

GONE_NODE_FORGET_S = 300.0
"""How long a dead node's actors stay listed (``kvray status`` shows them "node gone")
before the manager forgets them; a node that comes back gets new ones (a new node id)."""
ENGINES_KEPT = 256
"""Engines a pool lists (``kvray status``, ``kvray doctor``): the most recent attaches."""


class PoolState:
    """One pool's registry of node actors, claims and ledger (see the module)."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.nodes: dict[tuple[str, int], NodeActors] = {}
        """``(node id, slot)`` -> that slot's actors on that node."""
        self.lookups: dict[str, LookupHandle] = {}
        """Node id -> its Lookup actor."""
        self.fingerprints: dict[str, dict[str, dict[str, Any]]] = {}
        """``namespace@layout`` -> hash domain -> how its instances hash blocks (vLLM's
        algorithm, the seed's source) and how many registered it."""
        self.engines: dict[str, dict[str, Any]] = {}
        """Engine (``host:pid`` of its scheduler) -> what it registered at attach, newest
        :data:`ENGINES_KEPT`."""
        self.generations: dict[str, int] = {}
        """``namespace@layout`` -> the newest generation an engine reset its blocks to
        (:meth:`reset_generation`)."""
        self.ledger = Ledger()
        """The blocks the pool's clients stored and removed (what Lookup actors follow to
        name their misses' reasons)."""
        self._gone_since: dict[str, float] = {}

    def sorted_nodes(self) -> list[NodeActors]:
        """Every node actor made so far, by node then slot."""
        return [self.nodes[k] for k in sorted(self.nodes)]

    def all_actors(self) -> list[Handle]:
        """Every actor made (for shutdown)."""
        actors: list[Handle] = [a.client for a in self.nodes.values()]
        actors += [a.ssd for a in self.nodes.values() if a.ssd is not None]
        return actors + list(self.lookups.values())

    def forget_gone(self, alive: Collection[str], after_s: float, now: float) -> list[str]:
        """Drop the actors of nodes not in ``alive`` for ``after_s`` (monotonic ``now``);
        returns the nodes forgotten."""
        forgotten = []
        for node in {k[0] for k in self.nodes} | set(self.lookups):
            if node in alive:
                self._gone_since.pop(node, None)
                continue
            if now - self._gone_since.setdefault(node, now) < after_s:
                continue
            for key in [k for k in self.nodes if k[0] == node]:
                del self.nodes[key]
            self.lookups.pop(node, None)
            self._gone_since.pop(node, None)
            forgotten.append(node)
            logger.info("pool %s: forgot the actors of node %s (gone)", self.pool, node)
        return forgotten

    def register_fingerprint(
        self, keys: str, fp: dict[str, Any], engine: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """An attaching instance's hash fingerprint for keys ``keys`` (``namespace@layout``),
        and the instance itself (``engine``: its name, ``kv_load_failure_policy``, ...);
        answers the other hash domains seen for the same keys (empty: all hash alike)."""
        if engine is not None:
            name = str(engine.get("engine", "?"))
            self.engines[name] = {**engine, "hash_domain": fp.get("hash_domain"), "at": time.time()}
            while len(self.engines) > ENGINES_KEPT:  # the oldest registration goes
                del self.engines[min(self.engines, key=lambda k: self.engines[k]["at"])]
        seen = self.fingerprints.setdefault(keys, {})
        entry = seen.setdefault(fp["hash_domain"], {**fp, "instances": 0})
        entry["instances"] += 1
        entry["last_seen"] = time.time()
        return [dict(v) for d, v in seen.items() if d != fp["hash_domain"]]

    def reset_generation(self, keys: str, mine: int) -> int:
        """An engine of keys ``keys`` (``namespace@layout``), at generation ``mine``,
        resets its pool blocks (vLLM's ``reset_cache``, after a weight update): the
        generation it moves to. A newer one than ``mine`` that another engine of the same
        keys reset to is joined (engines updated together share again); otherwise a new
        one is started. Blocks of older generations are never looked up again by the
        engines that moved, and leave the pool by eviction."""
        newest = max(self.generations.get(keys, 0), mine)
        gen = newest if newest > mine else mine + 1
        self.generations[keys] = gen
        logger.info("pool %s: engines of %s reset to generation %d", self.pool, keys, gen)
        return gen

    def engine_list(self) -> list[dict[str, Any]]:
        """The engines that attached, oldest first."""
        return sorted(self.engines.values(), key=lambda e: float(e["at"]))

    def ledger_since(self, seq: int) -> tuple[int, Changes, bool, list[str]]:
        """A Lookup actor's update: the ledger's changes after ``seq`` (or all of it), and
        the ``namespace@layout`` that instances hashing blocks differently share."""
        new_seq, entries, full = self.ledger.since(seq)
        mixed = [k for k, domains in self.fingerprints.items() if len(domains) > 1]
        return new_seq, entries, full, mixed
