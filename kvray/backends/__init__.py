"""Storage backend adapters behind one contract (:mod:`kvray.backends.base`)."""

from __future__ import annotations

from kvray.backends.base import Backend, KeyStatus
from kvray.config import PoolConfig

__all__ = ["Backend", "KeyStatus", "make_backend"]


def make_backend(
    config: PoolConfig, server_address: str, *, contribute_memory: bool = True
) -> Backend:
    """Build the backend client ``config.backend`` names; native modules import lazily so
    that a process only loads the backend it uses."""
    if config.backend == "mooncake":
        from kvray.backends.mooncake import MooncakeBackend

        return MooncakeBackend(
            config.mooncake,
            server_address,
            io_threads=config.io_threads,
            contribute_memory=contribute_memory,
        )
    raise AssertionError(f"PoolConfig validation admitted unknown backend {config.backend!r}")
