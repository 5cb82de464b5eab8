"""A key's pieces copied into and out of its contiguous value (kvray/backends/base.py):
one strided copy per run of pieces of one size at one stride (a block's per-layer K/V in
vLLM's KV cache), one memmove for each other piece; byte for byte either way."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.backends.base import gather_pieces, scatter_pieces


def _pieces(buf: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
    return [buf.ctypes.data + o for o in offsets]


@pytest.mark.parametrize(
    ("offsets", "sizes"),
    [
        ([0, 4096, 8192, 12288], [1024] * 4),  # per-layer pieces: one stride
        ([100, 1100], [1000, 1000]),  # adjacent pieces
        ([0, 4096, 9000, 12288], [1024] * 4),  # uneven stride
        ([0, 4096, 8192], [1024, 512, 1024]),  # uneven sizes
        ([5000], [3000]),  # one piece
        ([8192, 4096, 0], [1024] * 3),  # descending: not a stride numpy may take
        ([0, 2048, 4096, 6144, 15000], [1024] * 4 + [8]),  # per-layer pieces, then a trailer
        ([0, 2048, 4096, 9000, 11000, 13000], [1024] * 6),  # two runs of two strides
        ([0, 3000, 6000, 7000, 8000], [1024, 1024, 1024, 512, 512]),  # two runs of two sizes
    ],
)
def test_pieces_round_trip_byte_for_byte(offsets: list[int], sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    region = rng.integers(0, 256, 16384, dtype=np.uint8)
    ptrs = _pieces(region, offsets, sizes)
    value = np.zeros(sum(sizes), np.uint8)
    gather_pieces(value.ctypes.data, ptrs, sizes)
    expect = np.concatenate([region[o : o + n] for o, n in zip(offsets, sizes, strict=True)])
    assert np.array_equal(value, expect)

    back = np.zeros_like(region)
    scatter_pieces(value.ctypes.data, _pieces(back, offsets, sizes), sizes)
    for o, n in zip(offsets, sizes, strict=True):
        assert np.array_equal(back[o : o + n], region[o : o + n])
    mask = np.ones(region.size, bool)
    for o, n in zip(offsets, sizes, strict=True):
        mask[o : o + n] = False
    assert not back[mask].any()  # nothing written outside the pieces


def test_pieces_are_copied_as_runs_of_one_size_at_one_stride() -> None:
    from kvray.backends.base import _runs

    assert _runs([0, 2048, 4096, 6144, 15000], [1024] * 4 + [8]) == [(0, 4, 2048), (4, 1, 8)]
    assert _runs([0, 2048, 4096, 9000, 11000], [1024] * 5) == [(0, 3, 2048), (3, 2, 2000)]
    assert _runs([8192, 4096, 0], [1024] * 3) == [(0, 1, 1024), (1, 1, 1024), (2, 1, 1024)]
    assert _runs([0, 500], [1000, 1000]) == [(0, 1, 1000), (1, 1, 1000)]  # overlapping
