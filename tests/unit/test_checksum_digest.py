"""The block digest is one function of the key and the bytes, however they are laid out:
a value sealed from its pieces (the Mooncake path) and one sealed or checked whole (the
datasystem's host path, which copies values itself) carry the same trailer."""

from __future__ import annotations

import numpy as np

from kvray.backends.checksum import TRAILER, _Trailers, _Verify, digest


def test_pieces_and_the_value_they_make_have_one_digest():
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 96, 70000, 1)]
    value = np.concatenate([*pieces, np.zeros(TRAILER, np.uint8)])
    ptrs = [[int(p.ctypes.data) for p in pieces]]
    sizes = [[p.nbytes for p in pieces]]
    slot = np.zeros(1, np.uint64)
    seal = _Trailers(["k"], ptrs, sizes, [int(slot.ctypes.data)])

    seal(0, 1)
    seal.in_value(0, int(value.ctypes.data), value.nbytes)
    assert int(slot[0]) == int(value[-TRAILER:].view(np.uint64)[0])
    assert int(slot[0]) == digest(b"k", [int(value.ctypes.data)], [value.nbytes - TRAILER])

    verify = _Verify(["k"], ptrs, sizes, [int(slot.ctypes.data)])
    assert verify.in_value(0, int(value.ctypes.data), value.nbytes)
    value[5000] ^= 1
    assert not verify.in_value(0, int(value.ctypes.data), value.nbytes)
    other = _Verify(["k2"], ptrs, sizes, [int(slot.ctypes.data)])
    value[5000] ^= 1
    assert not other.in_value(0, int(value.ctypes.data), value.nbytes)
