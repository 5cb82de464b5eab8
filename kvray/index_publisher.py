"""A pool actor's side of the block-index stream (kvray/index_stream.py): it hands the
changes it makes to its node's index keeper before the call that made them returns, and
queues them for the manager's hub, for the other nodes.

Used by the BackendClient (what each tier stored, removed, or a load found gone) and by
the SSD offload actor (what its quota evicted, and what it holds at start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

import ray

from kvray.block_index import key_digests
from kvray.config import PoolConfig
from kvray.errors import KVRayError
from kvray.index_stream import IndexChange
from kvray.launcher import ManagerLink
from kvray.naming import lookup_name
from kvray.remote import LookupHandle, ManagerHandle

logger = logging.getLogger(__name__)

KEEPER_RETRY_S = 5.0
"""How long a publisher waits before it looks for its node's index keeper again."""


class IndexPublisher:
    """One actor's changes to the pool's block indexes; :meth:`run` is its background
    task (sends to the hub), :meth:`publish` is awaited by the call that made them."""

    def __init__(self, config: PoolConfig, node_id: str, who: str) -> None:
        self._config = config
        self.node_id = node_id
        self._who = who
        self._for_hub: list[IndexChange] = []
        self._hub_ready = asyncio.Event()
        self._keeper: LookupHandle | None = None
        self._keeper_retry_at = 0.0
        self._warned = False

    def changes(self, op: int, keys: list[str], slot: int | None = None) -> IndexChange:
        """``keys`` that the DRAM tier (``slot`` None) or this node's SSD tier of ``slot``
        took or let go (``op``)."""
        digests = key_digests(keys).astype("<u8").tobytes()
        if slot is None:
            return IndexChange(op, digests)
        return IndexChange(op, digests, self.node_id, slot)

    async def run(self) -> None:
        """Send what was published to the manager's hub: one report in flight, what comes
        meanwhile goes in the next."""
        manager = ManagerLink(self._config, self._who, "other nodes' block indexes miss it")
        while True:
            await self._hub_ready.wait()
            self._hub_ready.clear()
            changes, self._for_hub = self._for_hub, []
            if changes:
                await manager.call(partial(ManagerHandle.index_record, changes=changes))

    async def publish(self, changes: list[IndexChange]) -> None:
        """Applied by this node's keeper before this returns (what a scheduler on this node
        reads next includes them), then queued for the hub. A keeper that cannot be
        reached is looked for again after a pause; meanwhile the hub brings it the
        changes."""
        if not changes:
            return
        self._for_hub.extend(changes)
        self._hub_ready.set()
        keeper = await self._find_keeper()
        if keeper is None:
            return
        try:
            await keeper.index_apply(changes).aresult(self._config.call_timeout_s)
        except KVRayError as exc:
            self._keeper, self._keeper_retry_at = None, time.monotonic() + KEEPER_RETRY_S
            if not self._warned:
                self._warned = True
                logger.warning(
                    "kvray %s: this node's block index did not take a change (%s); it gets "
                    "it from the pool's stream",
                    self._who,
                    exc,
                )

    async def _find_keeper(self) -> LookupHandle | None:
        if self._keeper is None and time.monotonic() >= self._keeper_retry_at:
            name = lookup_name(self._config.name, self.node_id)
            try:
                actor = await asyncio.to_thread(
                    ray.get_actor, name, namespace=self._config.namespace
                )
            except ValueError:  # no scheduler on this node asked for one yet
                self._keeper_retry_at = time.monotonic() + KEEPER_RETRY_S
                return None
            self._keeper = LookupHandle(actor, f"Lookup@{self.node_id[:8]}")
        return self._keeper
