"""The staged placement's block geometry and copies, with synthetic KV caches in the
layouts vLLM's attention backends use, through a real shared region: byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvray.connector.kv_geometry import block_dim_of, geometry_tag, layer_geometry
from kvray.connector.staging import Stager
from kvray.errors import ConfigError
from kvray.shm import mapped_regions

NB, BS, H, D = 12, 16, 4, 8


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _permuted(logical: tuple[int, ...], order: tuple[int, ...], dtype, seed) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """A tensor of logical shape ``logical`` whose memory is laid out in ``order`` (the
    way vLLM views a physical cache through a stride order)."""
    phys = _rand(tuple(logical[i] for i in order), dtype, seed)
    inverse = tuple(order.index(i) for i in range(len(order)))
    return phys.permute(*inverse)


def _layers(kind: str, n_layers: int = 3, dtype=torch.float16):  # type: ignore[no-untyped-def]
    """name -> KV entry in the layout ``kind``; and each layer's block dimension."""
    out = {}
    for i in range(n_layers):
        if kind == "vllm032":  # logical [B, H, N, C], C = K and V channels
            e = _rand((NB, H, BS, 2 * D), dtype, i)
        elif kind == "vllm032-nhd":  # the same logical view over a [B, N, H, C] memory order
            e = _permuted((NB, H, BS, 2 * D), (0, 2, 1, 3), dtype, i)
        elif kind == "flash":  # FlashAttention: K/V planes outside the blocks
            e = _rand((2, NB, BS, H, D), dtype, i)
        elif kind == "ascend":  # vLLM-Ascend: a (k_cache, v_cache) tuple
            e = (_rand((NB, BS, H, D), dtype, 2 * i), _rand((NB, BS, H, D), dtype, 2 * i + 1))
        elif kind == "mla":  # one latent cache
            e = _rand((NB, BS, 3 * D), dtype, i)
        elif kind == "heads-outer":  # blocks not outermost in memory: [H, B, N, C] order
            e = _permuted((NB, H, BS, 2 * D), (1, 0, 2, 3), dtype, i)
        else:
            raise AssertionError(kind)
        out[f"model.layers.{i}.self_attn"] = e
    return out


def _planes(entry):  # type: ignore[no-untyped-def]
    return [entry] if isinstance(entry, torch.Tensor) else list(entry)


def _expected(entry, b: int) -> bytes:  # type: ignore[no-untyped-def]
    """What kvray must store for block ``b`` of a layer: each plane's block, logical order."""
    out = b""
    for plane in _planes(entry):
        d = 1 if plane.shape[0] == 2 and plane.dim() == 5 else 0
        out += plane.select(d, b).contiguous().view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize(
    "kind", ["vllm032", "vllm032-nhd", "flash", "ascend", "mla", "heads-outer"]
)
def test_round_trip_is_byte_exact(kind):
    caches = _layers(kind)
    original = {n: [p.clone() for p in _planes(e)] for n, e in caches.items()}
    stager = Stager(caches, NB, 1 << 20, "kvray-test-stage")
    try:
        blocks = [7, 2, 11, 0]
        first = stager.reserve(len(blocks))
        assert first == 0
        stager.gather(blocks, first)
        offsets, lengths = stager.offsets(first, len(blocks))
        assert offsets.shape == (len(blocks), stager.columns)
        buf = stager.region.array
        for i, b in enumerate(blocks):
            got = b"".join(
                buf[o : o + n].tobytes() for o, n in zip(offsets[i], lengths[i], strict=True)
            )
            want = b"".join(_expected(e, b) for e in caches.values())
            assert got == want, f"block {b}"
        # Wipe the blocks, scatter them back from staging: the cache is restored exactly.
        for e in caches.values():
            for p in _planes(e):
                d = 1 if p.shape[0] == 2 and p.dim() == 5 else 0
                p.index_fill_(d, torch.tensor(blocks), 0)
        stager.scatter(blocks, first, range(len(blocks)))
        for n, e in caches.items():
            for p, o in zip(_planes(e), original[n], strict=True):
                assert torch.equal(p.view(torch.uint8), o.view(torch.uint8)), n
        stager.release(first, len(blocks))
    finally:
        stager.close()


def test_memory_order_does_not_change_stored_bytes():
    """Two engines whose caches have the same logical view over different memory orders
    store the same bytes (one key layout serves both)."""
    a, b = _layers("vllm032"), _layers("vllm032-nhd")
    for ea, eb in zip(a.values(), b.values(), strict=True):
        eb.copy_(ea)  # same values, different strides
        assert ea.stride() != eb.stride()
    sa, sb = Stager(a, NB, 1 << 20, "kvray-test-a"), Stager(b, NB, 1 << 20, "kvray-test-b")
    try:
        for s in (sa, sb):
            s.gather([3, 9], s.reserve(2))
        used = sa.seg_base[-1] + sa.seg_bytes[-1] * sa.capacity
        assert np.array_equal(sa.region.array[:used], sb.region.array[:used])
        assert geometry_tag(sa.geometry) == geometry_tag(sb.geometry) == f"p{H}x{BS}x{2 * D}"
    finally:
        sa.close()
        sb.close()


def test_only_loaded_rows_are_scattered():
    caches = _layers("flash", n_layers=2)
    stager = Stager(caches, NB, 1 << 20, "kvray-test-rows")
    try:
        first = stager.reserve(3)
        stager.gather([1, 2, 3], first)
        before = {n: e.clone() for n, e in caches.items()}
        # slots hold blocks 1,2,3; the load of the middle one "failed": scatter rows 0 and 2
        # into blocks 5 and 6, leave everything else alone
        stager.scatter([5, 6], first, [0, 2])
        for n, e in caches.items():
            assert torch.equal(e[:, 5], before[n][:, 1]) and torch.equal(e[:, 6], before[n][:, 3])
            mask = torch.ones(NB, dtype=torch.bool)
            mask[[5, 6]] = False
            assert torch.equal(e[:, mask], before[n][:, mask])
    finally:
        stager.close()


@pytest.mark.parametrize("kind", ["flash", "ascend"])
def test_column_ranges_move_only_their_layers(kind):
    """Layer-wise transfers gather and scatter one group of segments at a time: each
    touches its own columns of the slots and its own layers of the cache, and group by
    group equals the whole-block round trip."""
    caches = _layers(kind, n_layers=4)
    whole = Stager(caches, NB, 1 << 20, "kvray-test-whole")
    parts = Stager(caches, NB, 1 << 20, "kvray-test-parts")
    try:
        blocks = [4, 9, 1]
        whole.gather(blocks, whole.reserve(3))
        first = parts.reserve(3)
        cols = parts.columns
        half = (cols // 2 // parts.planes_per_layer) * parts.planes_per_layer
        for lo, hi in [(half, cols), (0, half)]:  # any order
            assert parts.gather(blocks, first, (lo, hi), wait=False) is None  # CPU: done
        used = whole.seg_base[-1] + whole.seg_bytes[-1] * whole.capacity
        assert np.array_equal(whole.region.array[:used], parts.region.array[:used])
        # Scatter only the second half's layers back into blocks 0, 2, 3.
        before = {n: [p.clone() for p in _planes(e)] for n, e in caches.items()}
        parts.scatter([0, 2, 3], first, [0, 1, 2], (half, cols), wait=False)
        layer_of_half = half // parts.planes_per_layer
        for i, (n, e) in enumerate(caches.items()):
            for p, old in zip(_planes(e), before[n], strict=True):
                d = 1 if p.dim() == 5 else 0
                if i < layer_of_half:
                    assert torch.equal(p, old), n  # first half untouched
                else:
                    src = old.index_select(d, torch.tensor(blocks))
                    assert torch.equal(p.index_select(d, torch.tensor([0, 2, 3])), src), n
    finally:
        whole.close()
        parts.close()


def test_slots_are_bounded_and_reused():
    caches = _layers("vllm032", n_layers=2)
    block_bytes = 2 * H * BS * 2 * D * 2
    stager = Stager(caches, NB, 5 * block_bytes + 7, "kvray-test-slots")
    try:
        assert stager.capacity == 5 and stager.region.spec.size == 5 * block_bytes
        a = stager.reserve(3)
        b = stager.reserve(2)
        assert (a, b) == (0, 3) and stager.reserve(1) is None
        stager.release(a, 3)
        assert stager.reserve(4) is None and stager.reserve(3) == 0
        stager.release(0, 3)
        stager.release(b, 2)
        assert stager.free_slots == 5 and stager.reserve(5) == 0
        with pytest.raises(ValueError, match="1..5 slots"):
            stager.reserve(6)
    finally:
        stager.close()


def test_staging_too_small_names_the_setting():
    with pytest.raises(ConfigError, match="raise kv_staging_size to at least"):
        Stager(_layers("mla", 1), NB, 100, "kvray-test-small")


def test_block_dimension_ambiguity():
    # A head dimension equal to the block count: the block dimension is the outer one.
    t = torch.zeros(6, 4, 6, 8)
    assert block_dim_of(t, 6, "l0") == 0
    assert block_dim_of(t.permute(2, 1, 0, 3), 6, "l0") == 2  # blocks still outermost in memory
    with pytest.raises(ConfigError, match="no dimension of the engine's 7 blocks"):
        block_dim_of(t, 7, "l0")
    same_stride = torch.zeros(6, 6).as_strided((6, 6), (1, 1))
    with pytest.raises(ConfigError, match="cannot tell which dimension"):
        block_dim_of(same_stride, 6, "l0")
    g = layer_geometry((torch.zeros(6, 2, 3), torch.zeros(6, 2, 3)), 6)
    assert geometry_tag(g) == "p2x3.p2x3" and g.nbytes == 2 * 6 * 4


def test_layers_of_different_geometry_are_refused():
    caches = {"a": torch.zeros(NB, 4, 8), "b": torch.zeros(NB, 4, 16)}
    with pytest.raises(ConfigError, match="differ in block geometry"):
        Stager(caches, NB, 1 << 20, "kvray-test-mixed")


def test_closed_stager_leaves_no_mapping():
    stager = Stager(_layers("mla", 1), NB, 1 << 16, "kvray-test-close")
    region = stager.region.spec.region_id
    stager.close()
    assert not any(region in str(v) for v in mapped_regions("kvray-test-close").values())


def test_placement_settings_are_validated():
    from kvray.config import ConnectorConfig, validate

    src = "kv_connector_extra_config"
    cfg = validate(
        ConnectorConfig, {"kv_placement": "staged", "kv_staging_size": "64MB"}, source=src
    )
    assert (cfg.kv_placement, cfg.kv_staging_size) == ("staged", 64 << 20)
    assert validate(ConnectorConfig, {}, source=src).kv_placement == "auto"
    with pytest.raises(ConfigError, match="kv_placement"):
        validate(ConnectorConfig, {"kv_placement": "gpu"}, source=src)
    with pytest.raises(ConfigError, match="kv_staging_size"):
        validate(ConnectorConfig, {"kv_staging_size": "lots"}, source=src)


def test_pools_that_move_device_memory_are_refused_by_the_connector():
    pytest.importorskip("vllm", reason="the connector package imports vLLM")
    from kvray.config import PoolConfig
    from kvray.connector.attach import check_host_transfers

    check_host_transfers(PoolConfig.from_dict({"backend": "yuanrong"}, environ={}))
    npu = {"backend": "yuanrong", "yuanrong": {"device": "npu"}}
    with pytest.raises(ConfigError, match="start the pool with yuanrong.device 'host'"):
        check_host_transfers(PoolConfig.from_dict(npu, environ={}))
    dev = {"backend": "memcache", "memcache": {"region": "device"}}
    with pytest.raises(ConfigError, match="start the pool with memcache.region 'host'"):
        check_host_transfers(PoolConfig.from_dict(dev, environ={}))


def test_engines_with_other_block_shapes_get_other_keys():
    """The key's layout tag (dtype, block size, head split) is the same for vLLM's CPU
    cache and a FlashAttention-style one; their bytes per block are ordered otherwise, so
    the key's geometry differs (kvray.keys.geometry_digest) and neither reads the other's
    blocks, whatever the pool remembers."""
    from kvray.connector.kv_geometry import geometry_tag, layer_geometry
    from kvray.keys import geometry_digest

    nb, heads, bs, hd = 8, 4, 16, 64
    cpu = torch.zeros(nb, heads, 2 * bs, hd)  # [B, H, 2N, D]
    flash = torch.zeros(2, nb, bs, heads, hd)  # (2, B, N, H, D)
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    a = geometry_digest(geometry_tag(layer_geometry(cpu, nb)), names)
    b = geometry_digest(geometry_tag(layer_geometry(flash, nb)), names)
    assert a != b
    assert a == geometry_digest(geometry_tag(layer_geometry(cpu.clone(), nb)), names)
