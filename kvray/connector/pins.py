"""Scheduler side: blocks held in vLLM's block pool until their saves ended.

vLLM frees a sliding-window block as soon as it leaves the window, at the next step's
allocation, while the request still runs; the save of that block, sent after the step
that computed it, may still be reading it (the shared placement's BackendClient reads the
KV cache itself). So the scheduler takes a reference on each such block as it plans its
save (``BlockPool.touch``, what vLLM's own prefix-cache hits do) and drops it once the
workers report every save of that step ended (``StepTimes.saved_through``): the block
returns to vLLM's free queue only then, and no other request can write it meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvray.connector.kv_groups import SLIDING, STATE

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

    from kvray.connector.kv_groups import KVGroup
    from kvray.connector.metadata import BlockOp
    from kvray.warn_once import WarnOnce


class BlockPins:
    """References this connector holds on blocks of vLLM's block pool, per step."""

    def __init__(self) -> None:
        self._pool: BlockPool | None = None
        self._by_step: dict[int, list[int]] = {}

    def bind(self, pool: BlockPool) -> None:
        self._pool = pool

    @property
    def held(self) -> int:
        """Block references held now."""
        return sum(len(ids) for ids in self._by_step.values())

    def pin(self, step: int, block_ids: list[int]) -> bool:
        """Hold ``block_ids`` until :meth:`release_through` passes ``step``; False (and
        nothing held) when vLLM gave no block pool (the save then reads blocks vLLM may
        reuse: the caller does not save them)."""
        if self._pool is None:
            return False
        if block_ids:
            pool = self._pool
            pool.touch([pool.blocks[b] for b in block_ids])
            self._by_step.setdefault(step, []).extend(block_ids)
        return True

    def pin_windows(
        self, step: int, groups: Sequence[KVGroup], warn_once: WarnOnce, ops: list[BlockOp]
    ) -> list[BlockOp]:
        """``ops`` of step ``step``, their sliding-window and state blocks (which vLLM frees
        mid-request) held until their saves ended; without a block pool to hold them in,
        those saves are dropped (said once), never sent over blocks vLLM may reuse."""
        if len(groups) < 2:
            return ops
        windowed = [op for op in ops if groups[op.group].kind in (SLIDING, STATE)]
        if self.pin(step, [b for op in windowed for b in op.block_ids]):
            return ops
        warn_once(
            "no-block-pool",
            "KVRayConnector: vLLM bound no block pool to the connector: sliding-window and "
            "state blocks are not stored (a hit of this model then needs them from vLLM's "
            "own cache)",
        )
        return [op for op in ops if groups[op.group].kind not in (SLIDING, STATE)]

    def release_through(self, step: int) -> None:
        """Drop the references of every step up to ``step`` (their saves ended)."""
        pool = self._pool
        if pool is None:
            return
        for s in sorted(s for s in self._by_step if s <= step):
            pool.free_blocks(pool.blocks[b] for b in self._by_step.pop(s))
