"""Storage backend adapters behind one contract (:mod:`kvray.backends.base`), and the
registry of what differs by backend (:mod:`kvray.backends.registry`)."""

from __future__ import annotations

from kvray.backends.base import Backend, KeyStatus
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig

__all__ = ["Backend", "KeyStatus", "make_backend"]


def make_backend(
    config: PoolConfig, server_address: str, *, contribute_memory: bool = True
) -> Backend:
    """The backend client ``config.backend`` names, with checksum trailers when
    ``config.checksum`` (host memory only)."""
    spec = spec_of(config.backend)
    backend = spec.make_client(config, server_address, contribute_memory)
    if config.checksum and spec.device_setting(config) is None:
        from kvray.backends.checksum import ChecksummedBackend

        return ChecksummedBackend(backend)
    return backend
