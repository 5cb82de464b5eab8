"""kvray's MemCache adapter over the FAKE MemCache data path (tests/fakes/memcache.py):
what the shared contract suite does not cover: lookup hits are leased (pinned) until
loaded or the lease ends, layer lists, and the error paths of a get."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvray.backends.base import KeyStatus
from kvray.backends.memcache import MemcacheBackend
from kvray.config import MemcacheConfig
from tests.fakes.memcache import FakeMemcacheCluster

URLS = {"meta_service_url": "tcp://127.0.0.1:1", "config_store_url": "tcp://127.0.0.1:2"}


@pytest.fixture
def cluster():
    return FakeMemcacheCluster(capacity=1 << 20)


def client(cluster, *, lookup: bool = False, lease_ttl_ms: int = 300) -> MemcacheBackend:
    cfg = MemcacheConfig(**URLS, lease_ttl_ms=lease_ttl_ms)
    return MemcacheBackend(cfg, contribute_memory=not lookup, store_factory=cluster.store_factory())


async def test_lookup_hits_are_leased_until_the_ttl(cluster):
    data, lookup = client(cluster), client(cluster, lookup=True)
    buf = np.arange(4096, dtype=np.uint8)
    await data.put(["a", "b"], [[buf.ctypes.data]] * 2, [[4096]] * 2)
    assert await lookup.exists(["a", "missing"]) == [True, False]
    assert await data.remove(["a", "b"]) == [KeyStatus.BUSY, KeyStatus.OK]  # only a is pinned
    time.sleep(0.35)
    assert await data.remove(["a"]) == [KeyStatus.OK]


async def test_data_clients_do_not_lease_and_force_drops_leases(cluster):
    data, lookup = client(cluster), client(cluster, lookup=True, lease_ttl_ms=60_000)
    buf = np.ones(64, dtype=np.uint8)
    await data.put(["k"], [[buf.ctypes.data]], [[64]])
    assert await data.exists(["k"]) == [True]
    assert await data.remove(["k"]) == [KeyStatus.OK]
    await data.put(["k"], [[buf.ctypes.data]], [[64]])
    await lookup.exists(["k"])
    assert await data.remove(["k"], force=True) == [KeyStatus.OK]


async def test_layers_and_get_errors(cluster):
    data = client(cluster)
    src = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
    dst = np.zeros_like(src)
    layers = [[src.ctypes.data + i * 1024 for i in range(8)]]
    assert await data.put(["layered"], layers, [[1024] * 8]) == [KeyStatus.OK]
    # read back as 2 pieces: a key is its layers concatenated
    two = [[dst.ctypes.data, dst.ctypes.data + 4096]]
    assert await data.get(["layered"], two, [[4096, 4096]]) == [KeyStatus.OK]
    assert np.array_equal(src, dst)
    assert await data.get(["layered"], [[dst.ctypes.data]], [[4096]]) == [KeyStatus.SIZE_MISMATCH]
    assert await data.get(["nope"], [[dst.ctypes.data]], [[64]]) == [KeyStatus.NOT_FOUND]


async def test_full_pool_and_overwrite(cluster):
    data = client(cluster)
    big = np.zeros(600 << 10, dtype=np.uint8)
    assert await data.put(["x"], [[big.ctypes.data]], [[big.nbytes]]) == [KeyStatus.OK]
    assert await data.put(["y"], [[big.ctypes.data]], [[big.nbytes]]) == [KeyStatus.POOL_FULL]
    assert await data.exists(["y"]) == [False]
    other = np.full(600 << 10, 7, dtype=np.uint8)
    assert await data.put(["x"], [[other.ctypes.data]], [[other.nbytes]], overwrite=True) == [
        KeyStatus.OK
    ]
    out = np.zeros_like(other)
    assert await data.get(["x"], [[out.ctypes.data]], [[out.nbytes]]) == [KeyStatus.OK]
    assert (out == 7).all()


async def test_a_client_conf_lives_only_through_its_init(cluster):
    """MemCache reads MMC_LOCAL_CONFIG_PATH at init only: the file is there for the init,
    with the typed config in it, and gone after it, so a killed actor leaves none."""
    from pathlib import Path

    from kvray.backends.memcache import local_conf_path

    make = cluster.store_factory()
    seen = []

    def recording():
        store = make()
        init = store.init

        def init_reading_the_conf(device_id, init_bm=True):
            seen.append(Path(local_conf_path()).read_text())
            return init(device_id, init_bm)

        store.init = init_reading_the_conf
        return store

    backend = MemcacheBackend(MemcacheConfig(**URLS), store_factory=recording)
    try:
        assert len(seen) == 1 and "tcp://127.0.0.1:1" in seen[0]
        assert not Path(local_conf_path()).exists(), "the conf outlived the init"
    finally:
        await backend.close()
