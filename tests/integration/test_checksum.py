"""Block checksums (kvray/backends/checksum.py) against the real Mooncake master and
datasystem worker: bytes changed inside the pool behind kvray's back, a value served
under another key, and a value stored without a trailer are never reported as loaded."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from kvray.backends import base
from kvray.backends.base import KeyStatus
from kvray.backends.checksum import TRAILER, ChecksummedBackend

from .backends import BACKENDS

pytestmark = pytest.mark.integration
BLOCK = 512 << 10
CHUNK = 4 << 20
N = 2 * CHUNK // BLOCK + 3
"""Blocks per batch: three groups (sealed and checked), so a bad block's status must land
in the right one."""
_ids = itertools.count()
_made: list[str] = []


@pytest.fixture(params=["mooncake", "yuanrong"])
async def store(request, monkeypatch):
    monkeypatch.setattr(base, "CHECK_GROUP_BYTES", CHUNK)
    monkeypatch.setattr(base, "SEAL_GROUP_BYTES", CHUNK)
    inner = BACKENDS[request.param](request)  # the contract suite's real-server clients
    wrapped = ChecksummedBackend(inner)
    yield wrapped
    await wrapped.remove(_made, force=True)  # the servers are the session's: leave room
    _made.clear()
    await wrapped.close()


@pytest.fixture
async def memory(store):
    """Sources, destinations and one raw value (block + trailer), registered."""
    buf = np.zeros(2 * N * BLOCK + BLOCK + TRAILER, dtype=np.uint8)
    buf[: N * BLOCK] = np.random.default_rng(1).integers(0, 256, N * BLOCK, dtype=np.uint8)
    await store.register_region(buf.ctypes.data, buf.nbytes)
    yield buf
    await store.unregister_region(buf.ctypes.data)


def _pieces(buf: np.ndarray, first: int, n: int, pieces: int = 1):  # type: ignore[no-untyped-def]
    step = BLOCK // pieces
    base = buf.ctypes.data + first * BLOCK
    return (
        [[base + b * BLOCK + p * step for p in range(pieces)] for b in range(n)],
        [[step] * pieces for _ in range(n)],
    )


def _keys(n: int) -> list[str]:
    run = next(_ids)
    keys = [f"checksum-{run}-{i}" for i in range(n)]
    _made.extend(keys)
    return keys


async def _raw_read(store: ChecksummedBackend, buf: np.ndarray, key: str) -> np.ndarray:
    """The value as the backend holds it: the block and its trailer."""
    at = 2 * N * BLOCK
    (st,) = await store.inner.get([key], [[buf.ctypes.data + at]], [[BLOCK + TRAILER]])
    assert st is KeyStatus.OK
    return buf[at : at + BLOCK + TRAILER]


async def _raw_write(store: ChecksummedBackend, buf: np.ndarray, key: str, size: int) -> None:
    at = 2 * N * BLOCK
    (st,) = await store.inner.put([key], [[buf.ctypes.data + at]], [[size]], overwrite=True)
    assert st is KeyStatus.OK


@pytest.mark.parametrize("pieces", [1, 16])
async def test_round_trip_over_several_chunks(store, memory, pieces):
    keys = _keys(N)
    assert await store.put(keys, *_pieces(memory, 0, N, pieces)) == [KeyStatus.OK] * N
    assert await store.get(keys, *_pieces(memory, N, N, pieces)) == [KeyStatus.OK] * N
    assert np.array_equal(memory[: N * BLOCK], memory[N * BLOCK : 2 * N * BLOCK])
    assert store.corrupt == 0


class _Stamp:
    """A seal that stamps each block's first byte with 0xA5: in the source before its
    group moves (``seal(lo, hi)``), or in the value the adapter copied (``in_value``)."""

    def __init__(self, memory: np.ndarray) -> None:
        self.memory = memory
        self.groups: list[tuple[int, int]] = []
        self.values: list[int] = []

    def __call__(self, lo: int, hi: int) -> None:
        self.groups.append((lo, hi))
        for i in range(lo, hi):
            self.memory[i * BLOCK] = 0xA5

    def in_value(self, i: int, value: int, nbytes: int) -> None:
        assert nbytes == BLOCK
        self.values.append(i)
        ctypes.c_uint8.from_address(value).value = 0xA5


async def test_a_put_seals_each_group_before_its_bytes_move(store, memory):
    """The adapters' ``seal`` hook covers the batch: Mooncake calls it once per group of
    at most SEAL_GROUP_BYTES, each before that group's native call copies it; the
    datasystem, whose copies are the adapter's own, once per key in the value it just
    copied (``in_value``). Either way every stored block carries the stamp, and the
    source is stamped only where the seal ran before the copy."""
    keys = _keys(N)
    stamp = _Stamp(memory)
    memory[: N * BLOCK : BLOCK] = 0
    assert await store.inner.put(keys, *_pieces(memory, 0, N), seal=stamp) == [KeyStatus.OK] * N
    if store.name == "mooncake":
        assert [i for lo, hi in sorted(stamp.groups) for i in range(lo, hi)] == list(range(N))
        assert len(stamp.groups) >= 3 and all((hi - lo) * BLOCK <= CHUNK for lo, hi in stamp.groups)
        assert not stamp.values
    else:
        assert sorted(stamp.values) == list(range(N)) and not stamp.groups
        assert (memory[: N * BLOCK : BLOCK] == 0).all()  # the stored values were stamped
    assert await store.inner.get(keys, *_pieces(memory, N, N)) == [KeyStatus.OK] * N
    assert (memory[N * BLOCK : 2 * N * BLOCK : BLOCK] == 0xA5).all()


async def test_a_flipped_byte_in_the_pool_is_a_corrupt_load_and_the_block_goes(store, memory):
    keys = _keys(N)
    assert await store.put(keys, *_pieces(memory, 0, N)) == [KeyStatus.OK] * N
    bad = N - 2  # in the last chunk
    value = await _raw_read(store, memory, keys[bad])
    value[BLOCK // 2] ^= 0x01  # one bit, in the payload, behind kvray's back
    await _raw_write(store, memory, keys[bad], BLOCK + TRAILER)

    statuses = await store.get(keys, *_pieces(memory, N, N))
    assert statuses == [KeyStatus.CORRUPT if i == bad else KeyStatus.OK for i in range(N)]
    assert store.corrupt == 1
    assert await store.exists([keys[bad], keys[0]]) == [False, True]
    good = [i for i in range(N) if i != bad]
    for i in good[:3] + good[-3:]:
        got = memory[(N + i) * BLOCK : (N + i + 1) * BLOCK]
        assert np.array_equal(got, memory[i * BLOCK : (i + 1) * BLOCK])


async def test_a_trailer_changed_in_the_pool_is_corrupt(store, memory):
    (key,) = _keys(1)
    assert await store.put([key], *_pieces(memory, 0, 1)) == [KeyStatus.OK]
    value = await _raw_read(store, memory, key)
    value[BLOCK] ^= 0x80
    await _raw_write(store, memory, key, BLOCK + TRAILER)
    assert await store.get([key], *_pieces(memory, N, 1)) == [KeyStatus.CORRUPT]


async def test_a_value_served_under_another_key_is_corrupt(store, memory):
    a, b = _keys(2)
    assert await store.put([a], *_pieces(memory, 0, 1)) == [KeyStatus.OK]
    await _raw_read(store, memory, a)
    await _raw_write(store, memory, b, BLOCK + TRAILER)  # a's exact value, stored as b
    assert await store.get([b], *_pieces(memory, N, 1)) == [KeyStatus.CORRUPT]
    assert await store.get([a], *_pieces(memory, N, 1)) == [KeyStatus.OK]


async def test_a_value_without_a_trailer_is_never_loaded(store, memory):
    (key,) = _keys(1)
    await _raw_write(store, memory, key, BLOCK)  # a bare block: a writer without checksums
    (st,) = await store.get([key], *_pieces(memory, N, 1))
    # Mooncake's multi-buffer get reports a value shorter than its pieces as a failed
    # transfer (-800, measured), the datasystem adapter as a size mismatch.
    assert st in (KeyStatus.SIZE_MISMATCH, KeyStatus.TRANSFER_FAILED)
