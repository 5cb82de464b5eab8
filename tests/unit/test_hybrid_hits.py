"""A hybrid model's pool hit (kvray/index/lookup.py ``servable_hits``): with state groups
(Mamba, linear attention) a hit of ``h`` blocks needs every attention column's blocks
``0..h-1`` and every state column's block ``h - 1``, the deepest such ``h``, not the
attention groups' longest run; without them, every column's leading run. The three
places that answer lookups (the Lookup actor's service, a scheduler's read of the node's
block index, ``Pool.prefix_match``) all give that answer."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping

import numpy as np
import pytest

from kvray.index.block_index import DRAM, BlockIndex, key_digests
from kvray.index.lookup import LookupService, leading_hits, servable_hits
from kvray.index.prefix_match import match
from kvray.keys import KeySpace

LAYOUT = "bfloat16-b16-h2x64"
N = 10
ATTN, STATE = 0, 1
GEO = ("0123456789ab", "ba9876543210")


def _space(tp: int = 1) -> KeySpace:
    """Group 0 attention, group 1 a state group; ``tp`` ranks."""
    return KeySpace(
        "unit", LAYOUT, tp_size=tp, geometries=GEO * tp, kv_groups=2, state_groups=(STATE,)
    )


def _present(space: KeySpace, held: Mapping[tuple[int, int], set[int] | range]) -> list[bool]:
    """Column-major presence of ``N`` blocks; ``held``: (rank, KV group) -> its blocks."""
    out = []
    for c in range(space.columns):
        rank, _, group = space.column(c)
        blocks = held.get((rank, group), set())
        out += [b in blocks for b in range(N)]
    return out


def test_columns_of_a_hybrid_space_are_rank_major_then_group():
    space = _space(tp=2)
    assert [space.column(c) for c in range(space.columns)] == [
        (0, 0, 0),
        (0, 0, 1),
        (1, 0, 0),
        (1, 0, 1),
    ]
    assert space.state_columns() == [False, True, False, True]


def test_a_state_past_the_attention_blocks_is_no_hit():
    # The state at block 8 and attention blocks 0..3: no boundary has both (not 4, not 9).
    space = _space()
    present = _present(space, {(0, ATTN): range(4), (0, STATE): {8}})
    assert servable_hits(present, N, space) == 0


def test_a_hit_ends_at_the_state_inside_the_attention_run():
    space = _space()
    # state after block 3, attention blocks 0..7: 4 blocks (not the attention's 8)
    present = _present(space, {(0, ATTN): range(8), (0, STATE): {3}})
    assert servable_hits(present, N, space) == 4
    # the deepest state inside the run, not the first or the last overall
    present = _present(space, {(0, ATTN): range(7), (0, STATE): {1, 3, 6, 9}})
    assert servable_hits(present, N, space) == 7
    present = _present(space, {(0, ATTN): range(6), (0, STATE): {1, 3, 6, 9}})
    assert servable_hits(present, N, space) == 4
    # every block everywhere: the whole prefix
    present = _present(space, {(0, ATTN): range(N), (0, STATE): {N - 1}})
    assert servable_hits(present, N, space) == N
    assert servable_hits([], 0, space) == 0


def test_every_ranks_state_column_must_hold_the_state():
    space = _space(tp=2)
    attn = {(0, ATTN): range(N), (1, ATTN): range(N)}
    # rank 1 lacks the state after block 3: the hit ends at the state both hold
    present = _present(space, {**attn, (0, STATE): {1, 3}, (1, STATE): {1}})
    assert servable_hits(present, N, space) == 2
    present = _present(space, {**attn, (0, STATE): {3}, (1, STATE): {1}})
    assert servable_hits(present, N, space) == 0
    # and every rank's attention column its blocks
    states = {(0, STATE): {1, 3}, (1, STATE): {1, 3}}
    present = _present(space, {(0, ATTN): range(N), (1, ATTN): range(3), **states})
    assert servable_hits(present, N, space) == 2


def test_without_state_groups_a_hit_is_every_columns_leading_run():
    space = KeySpace("unit", LAYOUT, tp_size=2, geometries=GEO * 2, kv_groups=2)
    rng = random.Random(7)
    answers = set()
    for _ in range(50):
        # mostly-present columns, so leading runs of every length occur
        present = [rng.random() < 0.93 for _ in range(space.columns * N)]
        want = leading_hits(present, N, space.columns)
        assert servable_hits(present, N, space) == want
        answers.add(want)
    assert len(answers) > 3, "the draws covered too few hit lengths to compare"


# ---- the same answer from every lookup path -------------------------------------------

HELD_CASES = [
    ({(0, ATTN): range(4), (1, ATTN): range(4), (0, STATE): {8}, (1, STATE): {8}}, 0),
    ({(0, ATTN): range(8), (1, ATTN): range(8), (0, STATE): {3}, (1, STATE): {3}}, 4),
    ({(0, ATTN): range(N), (1, ATTN): range(N), (0, STATE): {1, 3}, (1, STATE): {1}}, 2),
    ({(0, ATTN): range(N), (1, ATTN): range(N), (0, STATE): {9}, (1, STATE): {9}}, N),
]


def _hashes() -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(N)]


def _keys(space: KeySpace, held: Mapping[tuple[int, int], set[int] | range]) -> list[str]:
    hs = _hashes()
    return [
        k
        for (rank, group), blocks in held.items()
        for k in space.rank_key_strs([hs[b] for b in blocks], rank, kv_group=group)
    ]


@pytest.fixture
def index():
    ix = BlockIndex.create(1000)
    yield ix
    ix.close()


@pytest.mark.parametrize(("held", "hits"), HELD_CASES)
def test_the_node_index_and_prefix_match_agree(index, held, hits):
    space = _space(tp=2)
    assert servable_hits(_present(space, held), N, space) == hits
    index.add(key_digests(_keys(space, held)))
    masks = np.full(space.columns, DRAM, dtype=np.uint32)
    got, _, present = index.lookup(space, _hashes(), masks)
    assert got == hits
    assert present.ravel().tolist() == _present(space, held)
    assert match(index, space, _hashes(), {}).dram == hits


class FakeExists:
    """FAKE backend: only ``exists``, over the keys a test stores."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = set(keys)

    async def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.keys for k in keys]


@pytest.mark.parametrize(("held", "hits"), HELD_CASES)
def test_the_lookup_service_agrees(held, hits):
    space = _space(tp=2)
    service = LookupService(FakeExists(_keys(space, held)))  # type: ignore[arg-type]
    answer = asyncio.run(service.lookup(space, _hashes(), 1.0))
    assert answer.hits == hits
    assert service.stats.lookup_hit_blocks == hits
