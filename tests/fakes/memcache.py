"""FAKE MemCache data path, for machines without the Ascend driver.

MemCache's data path (a client that contributes memory: ``init(..., init_bm=True)``)
cannot run without the Ascend driver, so kvray's MemCache adapter is checked against this
in-process fake of ``memcache_hybrid.DistributedObjectStore``. It reproduces MemCache's
documented and measured semantics, nothing more:

- keys of 1..256 characters, else -3000 (INVALID_PARAM); at most 16384 keys per batch and
  255 pieces ("layers") per key, else -3000;
- first write wins: a put of an existing key writes nothing and returns -3006
  (DUPLICATED_OBJECT);
- a put beyond the pool's capacity returns -3016 (NOT_ENOUGH_MEMORY) and stores nothing;
- a get of a missing key returns -3102 (UNMATCHED_KEY, as the real 1.3.0 client answers),
  a get into pieces whose sizes do not add up to the object's returns -3000;
- ``batch_is_exist``: 1 present, 0 absent, -3000 invalid key;
- leases: ``batch_add_lease`` pins present keys for a TTL (missing: -3102); removing a
  pinned key returns -3104 (LEASE_NOT_EXPIRED) until ``batch_remove_lease`` or expiry;
  ``batch_remove_lease`` of keys without a lease returns -3106;
- ``batch_get_key_info``: an object whose ``size()`` is 0 for a missing key;
- ``direct``: 3 (host->pool) for puts and 2 (pool->host) for gets on host memory; the
  device codes (0, 1) are refused (-3000) because no device memory exists here.

Bytes really move (``ctypes.memmove`` from and to the given addresses), so round trips
through the adapter are checked byte for byte. All clients created from one
:class:`FakeMemcacheCluster` share its objects, as clients of one MetaService do.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field

INVALID_PARAM, DUPLICATED, NOT_ENOUGH_MEMORY = -3000, -3006, -3016
UNMATCHED_KEY, LEASE_NOT_EXPIRED, LEASE_EXPIRED = -3102, -3104, -3106
HOST_TO_POOL, POOL_TO_HOST = 3, 2


@dataclass
class _KeyInfo:
    _size: int

    def size(self) -> int:
        return self._size


@dataclass
class FakeMemcacheCluster:
    """The shared state a MetaService and its local services would hold."""

    capacity: int = 64 << 20
    objects: dict[str, bytes] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def used(self) -> int:
        return sum(len(v) for v in self.objects.values())

    def store_factory(self):  # type: ignore[no-untyped-def]
        return lambda: FakeDistributedObjectStore(self)


def _bad_key(key: str) -> bool:
    return not 0 < len(key) <= 256


class FakeDistributedObjectStore:
    """The subset of ``DistributedObjectStore`` kvray's adapter calls (FAKE)."""

    def __init__(self, cluster: FakeMemcacheCluster) -> None:
        self._c = cluster
        self._inited = False
        self.registered: dict[int, int] = {}

    def init(self, device_id: int, init_bm: bool = True) -> int:
        self._inited = True
        return 0

    def close(self) -> int:
        self._inited = False
        return 0

    def _pinned(self, key: str) -> bool:
        until = self._c.leases.get(key)
        if until is None:
            return False
        if until < time.monotonic():
            del self._c.leases[key]
            return False
        return True

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        with self._c.lock:
            return [INVALID_PARAM if _bad_key(k) else int(k in self._c.objects) for k in keys]

    def batch_add_lease(self, keys: list[str], leaseTtlMs: int = 0) -> list[int]:  # noqa: N803
        with self._c.lock:
            out = []
            for k in keys:
                if k in self._c.objects:
                    self._c.leases[k] = time.monotonic() + leaseTtlMs / 1e3
                    out.append(0)
                else:
                    out.append(UNMATCHED_KEY)
            return out

    def batch_remove_lease(self, keys: list[str]) -> int:
        with self._c.lock:
            had = [self._c.leases.pop(k, None) is not None for k in keys]
            return 0 if any(had) else LEASE_EXPIRED

    def batch_put_from_layers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], direct: int = 3
    ) -> list[int]:
        if direct != HOST_TO_POOL or len(keys) > 16384:
            return [INVALID_PARAM] * len(keys)
        out = []
        with self._c.lock:
            for k, p, s in zip(keys, ptrs, sizes, strict=True):
                if _bad_key(k) or not p or len(p) > 255 or len(p) != len(s):
                    out.append(INVALID_PARAM)
                elif k in self._c.objects:
                    out.append(DUPLICATED)
                elif self._c.used() + sum(s) > self._c.capacity:
                    out.append(NOT_ENOUGH_MEMORY)
                else:
                    self._c.objects[k] = b"".join(
                        ctypes.string_at(a, n) for a, n in zip(p, s, strict=True)
                    )
                    out.append(0)
        return out

    def batch_get_into_layers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], direct: int = 2
    ) -> list[int]:
        if direct != POOL_TO_HOST or len(keys) > 16384:
            return [INVALID_PARAM] * len(keys)
        out = []
        with self._c.lock:
            for k, p, s in zip(keys, ptrs, sizes, strict=True):
                value = None if _bad_key(k) else self._c.objects.get(k)
                if _bad_key(k):
                    out.append(INVALID_PARAM)
                elif value is None:
                    out.append(UNMATCHED_KEY)
                elif sum(s) != len(value) or len(p) != len(s):
                    out.append(INVALID_PARAM)
                else:
                    offset = 0
                    for a, n in zip(p, s, strict=True):
                        ctypes.memmove(a, value[offset : offset + n], n)
                        offset += n
                    out.append(0)
        return out

    def batch_get_key_info(self, keys: list[str]) -> list[_KeyInfo]:
        with self._c.lock:
            return [_KeyInfo(len(self._c.objects.get(k, b""))) for k in keys]

    def remove_batch(self, keys: list[str]) -> list[int]:
        out = []
        with self._c.lock:
            for k in keys:
                if _bad_key(k):
                    out.append(INVALID_PARAM)
                elif k not in self._c.objects:
                    out.append(UNMATCHED_KEY)
                elif self._pinned(k):
                    out.append(LEASE_NOT_EXPIRED)
                else:
                    del self._c.objects[k]
                    out.append(0)
        return out

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        self.registered[buffer_ptr] = size
        return 0

    def unregister_buffer(self, buffer_ptr: int, size: int) -> int:
        return 0 if self.registered.pop(buffer_ptr, None) == size else INVALID_PARAM
