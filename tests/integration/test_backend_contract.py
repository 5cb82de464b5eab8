"""The backend contract (kvray/backends/base.py), checked directly against each backend:
the real Mooncake and datasystem servers (each also behind kvray's checksum trailers, the
pool's default), kvray's SSD tier on the real disk, and kvray's MemCache adapter over a FAKE
MemCache data path (tests/fakes/memcache.py: the real one needs the Ascend driver). A new
backend joins by adding a factory to BACKENDS; the tests stay unchanged."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvray.backends.base import KeyStatus
from kvray.config import MooncakeConfig, YuanrongConfig
from kvray.errors import BackendUnavailableError
from kvray.servers.process import free_port

from .backends import BACKENDS

pytestmark = pytest.mark.integration
_ids = itertools.count()
BLOCK = 64 << 10


UNREACHABLE = {
    "mooncake": lambda address: _import("mooncake").MooncakeBackend(
        MooncakeConfig(protocol="tcp"), address
    ),
    "yuanrong": lambda address: _import("yuanrong").YuanrongBackend(
        YuanrongConfig(worker_address=address, connect_timeout_ms=2000), address
    ),
    "memcache": lambda address: _import("memcache").MemcacheBackend(
        _memcache_config(f"tcp://{address}"), contribute_memory=False
    ),
}
"""How each backend's client is made against an address where nothing listens."""


def _memcache_config(url: str):  # type: ignore[no-untyped-def]
    from kvray.config import MemcacheConfig

    return MemcacheConfig(meta_service_url=url, config_store_url="tcp://127.0.0.1:1")


def _import(name: str):  # type: ignore[no-untyped-def]
    import importlib

    return importlib.import_module(f"kvray.backends.{name}")


@pytest.fixture(params=sorted(BACKENDS))
async def backend(request):
    b = BACKENDS[request.param](request)
    yield b
    await b.close()


@pytest.fixture
def memory():
    """A registered-to-be buffer: 16 blocks for sources, 16 for destinations."""
    buf = np.zeros(32 * BLOCK, dtype=np.uint8)
    buf[: 16 * BLOCK] = np.random.default_rng(0).integers(0, 256, 16 * BLOCK, dtype=np.uint8)
    return buf


def ptrs(
    buf: np.ndarray, blocks: list[int], pieces: int = 1
) -> tuple[list[list[int]], list[list[int]]]:
    step = BLOCK // pieces
    base = buf.ctypes.data
    return (
        [[base + b * BLOCK + p * step for p in range(pieces)] for b in blocks],
        [[step] * pieces for _ in blocks],
    )


def keys(n: int) -> list[str]:
    run = next(_ids)
    return [f"contract-{run}-{i}" for i in range(n)]


async def test_put_get_round_trip_single_and_multi_piece(backend, memory):
    await backend.register_region(memory.ctypes.data, memory.nbytes)
    for pieces in (1, 4):
        ks = keys(4)
        assert await backend.put(ks, *ptrs(memory, [0, 1, 2, 3], pieces)) == [KeyStatus.OK] * 4
        assert await backend.exists(ks) == [True] * 4
        memory[16 * BLOCK :] = 0
        assert await backend.get(ks, *ptrs(memory, [16, 17, 18, 19], pieces)) == [KeyStatus.OK] * 4
        assert np.array_equal(memory[: 4 * BLOCK], memory[16 * BLOCK : 20 * BLOCK])
    await backend.unregister_region(memory.ctypes.data)


async def test_missing_keys_in_a_batch(backend, memory):
    await backend.register_region(memory.ctypes.data, memory.nbytes)
    ks = keys(3)
    await backend.put(ks[:1], *ptrs(memory, [0]))
    assert await backend.exists(ks) == [True, False, False]
    got = await backend.get(ks, *ptrs(memory, [16, 17, 18]))
    assert got == [KeyStatus.OK, KeyStatus.NOT_FOUND, KeyStatus.NOT_FOUND]


async def test_first_write_wins_and_overwrite(backend, memory):
    await backend.register_region(memory.ctypes.data, memory.nbytes)
    (k,) = keys(1)
    assert await backend.put([k], *ptrs(memory, [0])) == [KeyStatus.OK]
    assert await backend.put([k], *ptrs(memory, [1])) == [KeyStatus.OK]  # kept the first
    await backend.get([k], *ptrs(memory, [16]))
    assert np.array_equal(memory[16 * BLOCK : 17 * BLOCK], memory[:BLOCK])
    await backend.remove([k], force=True)  # drop the read lease the get took
    assert await backend.put([k], *ptrs(memory, [1])) == [KeyStatus.OK]
    (k2,) = keys(1)
    await backend.put([k2], *ptrs(memory, [0]))
    assert await backend.put([k2], *ptrs(memory, [2], 4), overwrite=True) == [KeyStatus.OK]
    await backend.get([k2], *ptrs(memory, [17]))
    assert np.array_equal(memory[17 * BLOCK : 18 * BLOCK], memory[2 * BLOCK : 3 * BLOCK])


async def test_size_mismatch_is_reported(backend, memory):
    await backend.register_region(memory.ctypes.data, memory.nbytes)
    (k,) = keys(1)
    await backend.put([k], *ptrs(memory, [0]))
    small = [[memory.ctypes.data + 16 * BLOCK]], [[BLOCK // 2]]
    assert await backend.get([k], *small) == [KeyStatus.SIZE_MISMATCH]


async def test_remove(backend, memory):
    await backend.register_region(memory.ctypes.data, memory.nbytes)
    ks = keys(2)
    await backend.put(ks[:1], *ptrs(memory, [0]))
    assert await backend.remove(ks, force=True) == [KeyStatus.OK, KeyStatus.NOT_FOUND]
    assert await backend.exists(ks) == [False, False]


async def test_empty_batches(backend):
    assert await backend.exists([]) == []
    assert await backend.put([], [], []) == []
    assert await backend.get([], [], []) == []
    assert await backend.remove([]) == []
    assert await backend.health()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(UNREACHABLE))
def test_unreachable_server_is_a_clear_error(name):
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(BackendUnavailableError, match=address):
        UNREACHABLE[name](address)
