"""Backend clients for the integration tests, made against the session's real servers
(tests/integration/conftest.py), and memory to move: shared by the contract suite
(test_backend_contract.py) and the tests that run over the same backends."""

from __future__ import annotations

import numpy as np

from kvray.backends.base import Backend
from kvray.config import MooncakeConfig, YuanrongConfig


def _mooncake(request) -> Backend:  # type: ignore[no-untyped-def]
    from kvray.backends.mooncake import MooncakeBackend

    master = request.getfixturevalue("mooncake_master")
    cfg = MooncakeConfig(global_segment_size=64 << 20, local_buffer_size=16 << 20, protocol="tcp")
    return MooncakeBackend(cfg, master.address, io_threads=2)


def _yuanrong(request) -> Backend:  # type: ignore[no-untyped-def]
    from kvray.backends.yuanrong import YuanrongBackend

    worker = request.getfixturevalue("ds_worker")
    cfg = YuanrongConfig(worker_address=worker.address, request_timeout_ms=3000)
    return YuanrongBackend(cfg, worker.address, io_threads=2)


def _memcache_fake(request) -> Backend:  # type: ignore[no-untyped-def]
    from kvray.backends.memcache import MemcacheBackend
    from kvray.config import MemcacheConfig
    from tests.fakes.memcache import FakeMemcacheCluster

    cfg = MemcacheConfig(meta_service_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2")
    return MemcacheBackend(cfg, store_factory=FakeMemcacheCluster().store_factory())


def _ssd(request) -> Backend:  # type: ignore[no-untyped-def]
    from kvray.backends.ssd import SsdBackend
    from kvray.config import SsdConfig

    path = request.getfixturevalue("tmp_path")
    return SsdBackend(SsdConfig(path=str(path), quota="64MB", io_threads=2), rank=0)


def _checksummed(factory):  # type: ignore[no-untyped-def]
    def make(request) -> Backend:  # type: ignore[no-untyped-def]
        from kvray.backends.checksum import ChecksummedBackend

        return ChecksummedBackend(factory(request))

    return make


BACKENDS = {
    "mooncake": _mooncake,
    "mooncake+checksum": _checksummed(_mooncake),
    "yuanrong": _yuanrong,
    "yuanrong+checksum": _checksummed(_yuanrong),
    "memcache-fake": _memcache_fake,
    "memcache-fake+checksum": _checksummed(_memcache_fake),
    "ssd": _ssd,
}
"""Each factory gets the test's ``request`` and pulls the server fixture it needs."""


def yuanrong_client(address: str, **cfg):  # type: ignore[no-untyped-def]
    """A datasystem client of the worker at ``address``, with short timeouts."""
    from kvray.backends.yuanrong import YuanrongBackend

    cfg = {"worker_address": address, "request_timeout_ms": 2000, **cfg}
    return YuanrongBackend(YuanrongConfig(**cfg), address, io_threads=2)


def blocks(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def addr(a: np.ndarray, pieces: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    step = a.shape[1] // pieces
    return (
        [[row.ctypes.data + p * step for p in range(pieces)] for row in a],
        [[step] * pieces for _ in a],
    )
