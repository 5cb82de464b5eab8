"""A key's pieces copied into and out of its contiguous value (kvray/backends/base.py):
one strided copy when the pieces are one size at one stride (a block's per-layer K/V in
vLLM's KV cache), one memmove each otherwise; byte for byte either way."""

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
