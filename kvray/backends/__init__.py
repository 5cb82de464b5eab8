"""Storage backend adapters behind one contract (:mod:`kvray.backends.base`)."""

from __future__ import annotations

from kvray.backends.base import Backend, KeyStatus
from kvray.config import PoolConfig

__all__ = ["Backend", "KeyStatus", "make_backend"]


def make_backend(
    config: PoolConfig, server_address: str, *, contribute_memory: bool = True
) -> Backend:
    """The backend client ``config.backend`` names, with checksum trailers when
    ``config.checksum`` (host memory only)."""
    backend = _native(config, server_address, contribute_memory=contribute_memory)
    if config.checksum and not (config.backend == "yuanrong" and config.yuanrong.device == "npu"):
        from kvray.backends.checksum import ChecksummedBackend

        return ChecksummedBackend(backend, threads=min(config.io_threads, 4))
    return backend


def _native(config: PoolConfig, server_address: str, *, contribute_memory: bool) -> Backend:
    """Native modules import lazily so that a process only loads the backend it uses."""
    if config.backend == "mooncake":
        from kvray.backends.mooncake import MooncakeBackend

        return MooncakeBackend(
            config.mooncake,
            server_address,
            io_threads=config.io_threads,
            contribute_memory=contribute_memory,
            replica_num=config.replica_num,
        )
    if config.backend == "memcache":
        from kvray.backends.memcache import MemcacheBackend

        return MemcacheBackend(
            config.memcache, contribute_memory=contribute_memory, io_threads=config.io_threads
        )
    if config.backend == "yuanrong":
        # A datasystem client contributes no memory either way: the worker owns it. It
        # connects to its node's worker (set by launcher.on_this_node), else the pool's.
        address = config.yuanrong.worker_address or server_address
        if config.yuanrong.device == "npu":
            from kvray.backends.yuanrong_npu import YuanrongDeviceBackend

            return YuanrongDeviceBackend(config.yuanrong, address, io_threads=config.io_threads)
        from kvray.backends.yuanrong import YuanrongBackend

        return YuanrongBackend(config.yuanrong, address, io_threads=config.io_threads)
    raise AssertionError(f"PoolConfig validation admitted unknown backend {config.backend!r}")
