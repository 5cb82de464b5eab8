"""Scheduler side of the pool's KV events (:mod:`kvray.index.kv_events`): the blocks
a step saves, described as vLLM's own ``BlockStored`` would describe them (block hash,
parent hash, token ids, extra keys such as the cache salt), sent to the pool's manager
with one call per step that saves, never waited for. The manager announces a block only
once its index holds every column of it, so a described block that fails to store is
never published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvray.errors import KVRayError
from kvray.index.kv_events import BlockInfo, Described, GroupInfo

if TYPE_CHECKING:
    from kvray.config import KVEventsConfig
    from kvray.connector.instance import InstanceInfo
    from kvray.connector.metadata import BlockOp
    from kvray.connector.request_state import RequestState
    from kvray.keys import KeySpace
    from kvray.remote import Call, ManagerHandle

logger = logging.getLogger(__name__)


def topic_of(config: KVEventsConfig, info: InstanceInfo, pool: str, host: str) -> str:
    """This engine's topic: ``kv_events.topic`` with its fields filled in."""
    return config.topic.format(
        host=host,
        model=info.model_name,
        instance=info.engine_id,
        pool=pool,
        namespace=info.space.namespace,
    )


class BlockDescriber:
    """Describes a step's saved blocks to the pool's manager."""

    def __init__(
        self, manager: ManagerHandle, info: InstanceInfo, topic: str, warn: Callable[..., None]
    ) -> None:
        self._manager = manager
        self._info = info
        self.topic = topic
        self._warn = warn
        self._call: Call[None] | None = None
        self._groups = tuple(
            GroupInfo(g.spec_kind or None, g.sliding_window or None) for g in info.groups
        )
        self.described = 0
        """Blocks described since start."""

    def describe(
        self, ops: Sequence[BlockOp], reqs: Mapping[str, RequestState], space: KeySpace
    ) -> None:
        """The blocks of ``ops``, just planned by ``plan_saves`` (their requests in
        ``reqs``), of ``space`` (the scheduler's, once its workers' geometries are
        known), in one call."""
        if not space.complete:
            return
        blocks: list[BlockInfo] = []
        for op in ops:
            st = reqs.get(op.req_id)
            if st is not None:
                blocks += self._blocks(op, st)
        if not blocks:
            return
        self._check()
        report = Described(space, self.topic, self._info.block_size, tuple(blocks), self._groups)
        self._call = self._manager.describe_blocks([report])
        self.described += len(blocks)

    def _check(self) -> None:
        """The previous report's outcome, once it is known (a failure is logged once)."""
        call = self._call
        if call is None or not call.done():
            return
        self._call = None
        try:
            call.result(None)
        except KVRayError as exc:
            self._warn("kv-events", "kvray: describing saved blocks for KV events failed: %s", exc)

    def _blocks(self, op: BlockOp, st: RequestState) -> list[BlockInfo]:
        """``op``'s blocks, planned just now: they end at the request's ``next_save``."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        from kvray.connector.request_state import hash_bytes

        request = st.request
        first = st.next_save - len(op.block_hashes)
        hashes = request.block_hashes
        if first < 0 or hash_bytes(hashes[first]) != op.block_hashes[0]:
            return []  # (not where plan_saves left them: nothing to say)
        size = self._info.block_size
        tokens = request.all_token_ids
        lora = request.lora_request
        parent = hash_bytes(hashes[first - 1]) if first else None
        out: list[BlockInfo] = []
        mm_idx = 0
        for i, block_hash in enumerate(op.block_hashes, first):
            start, end = i * size, (i + 1) * size
            extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            (event_extra,) = to_event_extra_keys([extra]) or [None]
            out.append(
                BlockInfo(
                    block_hash,
                    parent,
                    tuple(tokens[start:end]),
                    event_extra,
                    lora.lora_name if lora else None,
                )
            )
            parent = block_hash
        return out
