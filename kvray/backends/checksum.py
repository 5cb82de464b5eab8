"""End-to-end block checksums for the DRAM tiers: a :class:`Backend` around another.

Every value is stored as the block's pieces followed by an 8-byte trailer, the xxh3-64 of
the key and the pieces. The trailer is one more piece of the same batch call, so it is
written with the block (stored whole or absent, as the block is) and read with it (on
Mooncake it takes the block into the allocator's next size class, usually an eighth
more segment: docs/reliability.md, "Block checksums"). On a
load the pieces' digest is computed from the destination memory before the call returns
(where the adapter copies values out itself, from the value right before its copy);
a block whose digest differs is reported :attr:`KeyStatus.CORRUPT` (the caller reports a
failed load, vLLM recomputes) and removed from the pool so that the next lookup misses
instead of hitting it again. The key is in the digest, so a value served under another
key fails too.

What it covers: whatever happens to the bytes between this client's put and a client's
get (the backend's memory, its transfers, its native SSD offload, a replica on another
node). What it does not: bytes written wrong by the writer itself (they are checksummed
as written), and device memory (the NPU device path stores no trailer).

Trailers live in a small registered arena of this client (8 bytes per key in flight).
A load is verified where its bytes land: the adapter moves the keys in groups of about
:data:`~kvray.backends.base.CHECK_GROUP_BYTES` and each group's digests run on the same
I/O thread right after its native call returned, while the bytes are still in that core's
cache (xxhash releases the GIL for pieces over 64 KiB, so the adapter's threads verify
whole blocks in parallel; vLLM's per-layer pieces are often smaller and hash one thread
at a time). A put is
sealed the same way: each group's digests run on the I/O thread right before its native
call, which then copies bytes the digests just read into that core's cache. Where the
adapter copies each value itself (the datasystem's host path), a key's digest runs right
after its copy, over the whole value as stored (one buffer: xxhash releases the GIL for
it where a key's per-layer pieces each would hold it). Cost: see
docs/reliability.md, "Block checksums" (bench_ttft's checksum rows, bench_store's
"checksum cost").
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvray.backends.base import Backend, Check, KeyStatus, Pieces, Seal

logger = logging.getLogger(__name__)

Slots = Sequence[int]
"""Addresses of trailer slots in the arena."""
TRAILER = 8
"""Bytes of the checksum stored after each block."""
ARENA_SLOTS = 1 << 16
"""Trailer slots registered at a time (512 KiB); more are added when batches need them."""


def digest(key: bytes, ptrs: Sequence[int], sizes: Sequence[int]) -> int:
    """xxh3-64 of the key and the bytes at ``ptrs`` (``sizes`` each), in order."""
    h = xxhash.xxh3_64(key)
    for p, n in zip(ptrs, sizes, strict=True):
        h.update((ctypes.c_char * n).from_address(p))
    return int(h.intdigest())


class _Arena:
    """Registered memory for the trailers of the batches in flight: slots of 8 bytes,
    handed out per batch and given back when its call returns."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._maps: list[np.ndarray] = []
        """Each a view of an anonymous mmap (which it keeps mapped)."""
        self._free: list[int] = []
        self._growing = asyncio.Lock()

    async def take(self, n: int) -> list[int]:
        while len(self._free) < n:
            async with self._growing:
                if len(self._free) < n:
                    await self._grow(max(n - len(self._free), ARENA_SLOTS))
        slots = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return slots

    def give(self, slots: list[int]) -> None:
        self._free.extend(slots)

    async def _grow(self, slots: int) -> None:
        m = mmap.mmap(-1, slots * TRAILER)
        words = np.frombuffer(m, dtype=np.uint64)
        base = int(words.ctypes.data)
        await self._backend.register_region(base, slots * TRAILER)
        self._maps.append(words)
        self._free.extend(range(base, base + slots * TRAILER, TRAILER))

    async def close(self) -> None:
        for words in self._maps:
            await self._backend.unregister_region(int(words.ctypes.data))
        self._maps.clear()  # the mmaps are unmapped once their arrays are collected
        self._free.clear()


class _Batch:
    """One batch's keys, pieces and trailer slots, and their digests."""

    def __init__(self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, slots: Slots) -> None:
        self._keys, self._ptrs, self._sizes, self._slots = keys, ptrs, sizes, slots

    def _of_pieces(self, i: int) -> int:
        """The digest of key ``i``'s pieces."""
        return digest(self._keys[i].encode(), self._ptrs[i], self._sizes[i])

    def _trailer(self, i: int) -> ctypes.c_uint64:
        """Key ``i``'s trailer slot."""
        return ctypes.c_uint64.from_address(self._slots[i])

    def _of_value(self, i: int, value: int, nbytes: int) -> tuple[int, int]:
        """(digest of key ``i``'s value at ``value`` but its trailer, the trailer's address)."""
        body = nbytes - TRAILER
        return digest(self._keys[i].encode(), [value], [body]), value + body


class _Trailers(_Batch):
    """The :class:`~kvray.backends.base.Seal` of one put: trailers into the arena's slots
    (from the pieces), or into a value the adapter copied whole."""

    def __call__(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            self._trailer(i).value = self._of_pieces(i)

    def in_value(self, i: int, value: int, nbytes: int) -> None:
        d, at = self._of_value(i, value, nbytes)
        ctypes.c_uint64.from_address(at).value = d


class _Verify(_Batch):
    """The :class:`~kvray.backends.base.Check` of one get: the pieces where they landed
    against the trailers in the arena's slots, or a value before the adapter copies it."""

    def __call__(self, lo: int, hi: int, statuses: list[KeyStatus]) -> list[KeyStatus]:
        return [
            KeyStatus.CORRUPT
            if st is KeyStatus.OK and self._of_pieces(i) != self._trailer(i).value
            else st
            for i, st in zip(range(lo, hi), statuses, strict=True)
        ]

    def in_value(self, i: int, value: int, nbytes: int) -> bool:
        d, at = self._of_value(i, value, nbytes)
        return d == ctypes.c_uint64.from_address(at).value


class ChecksummedBackend(Backend):
    """``inner`` with a checksum trailer on every value (see the module)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self._arena = _Arena(inner)
        self.corrupt = 0
        """Blocks whose bytes failed their checksum on a load, since start."""

    @staticmethod
    def _with_trailers(
        ptrs: Pieces, sizes: Pieces, slots: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        return (
            [[*p, slot] for p, slot in zip(ptrs, slots, strict=True)],
            [[*s, TRAILER] for s in sizes],
        )

    async def put(
        self,
        keys: Sequence[str],
        ptrs: Pieces,
        sizes: Pieces,
        *,
        overwrite: bool = False,
        seal: Seal | None = None,
    ) -> list[KeyStatus]:
        if seal is not None:
            raise ValueError("a checksummed backend seals its puts itself")
        if not keys:
            return []
        slots = await self._arena.take(len(keys))
        try:
            return await self.inner.put(
                keys,
                *self._with_trailers(ptrs, sizes, slots),
                overwrite=overwrite,
                seal=_Trailers(keys, ptrs, sizes, slots),
            )
        finally:
            self._arena.give(slots)

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if check is not None:
            raise ValueError("a checksummed backend verifies its loads itself")
        if not keys:
            return []
        slots = await self._arena.take(len(keys))
        try:
            verify = _Verify(keys, ptrs, sizes, slots)
            out = await self.inner.get(keys, *self._with_trailers(ptrs, sizes, slots), check=verify)
        finally:
            self._arena.give(slots)
        bad = [k for k, st in zip(keys, out, strict=True) if st is KeyStatus.CORRUPT]
        if bad:
            self.corrupt += len(bad)
            logger.warning(
                "%d block(s) failed their checksum on load (first: %s): reported as failed "
                "loads and removed from the pool",
                len(bad),
                bad[0],
            )
            try:
                await self.inner.remove(bad, force=True)
            except Exception as exc:  # the load's outcome stands either way
                logger.warning("removing %d corrupt block(s) failed: %s", len(bad), exc)
        return out

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        return await self.inner.remove(keys, force=force)

    async def register_region(self, ptr: int, size: int) -> None:
        await self.inner.register_region(ptr, size)

    async def unregister_region(self, ptr: int) -> None:
        await self.inner.unregister_region(ptr)

    async def health(self) -> bool:
        return await self.inner.health()

    def info(self) -> dict[str, Any]:
        return {**self.inner.info(), "checksum": "xxh3-64"}

    async def close(self) -> None:
        try:
            await self._arena.close()
        finally:
            await self.inner.close()
