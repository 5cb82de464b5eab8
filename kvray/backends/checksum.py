"""End-to-end block checksums for the DRAM tiers: a :class:`Backend` around another.

Every value is stored as the block's pieces followed by an 8-byte trailer, the xxh3-64 of
the key and the pieces. The trailer is one more piece of the same batch call, so it is
written with the block (stored whole or absent, as the block is) and read with it. On a
load the pieces' digest is computed from the destination memory before the call returns;
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
cache (xxhash releases the GIL, so the adapter's threads verify in parallel). A put is
sealed on threads of their own in chunks of ~:data:`CHUNK_BYTES`, a chunk's digests
computed while the previous chunk's bytes move. Cost: see docs/reliability.md, "Block
checksums" (bench_ttft's checksum rows, bench_store's "checksum cost").
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvray.backends.base import Backend, Check, KeyStatus, Pieces
from kvray.backends.blocking import BlockingCalls

logger = logging.getLogger(__name__)

Slots = Sequence[int]
"""Addresses of trailer slots in the arena."""
TRAILER = 8
"""Bytes of the checksum stored after each block."""
CHUNK_BYTES = 64 << 20
"""A put is sealed and moved in chunks of about this many bytes, pipelined (measured on 2
cores: 8 MiB chunks cost a quarter of the put rate in call overhead, 64 MiB none)."""
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


def _chunks(sizes: Pieces, limit: int) -> list[tuple[int, int]]:
    bounds, lo, acc = [], 0, 0
    for i, s in enumerate(sizes):
        acc += sum(s)
        if acc >= limit:
            bounds.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(sizes):
        bounds.append((lo, len(sizes)))
    return bounds


def _runs(sizes: Pieces, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of ``sizes``' items, at most ``parts``, of about equal bytes."""
    total = sum(sum(s) for s in sizes)
    if parts <= 1 or total == 0:
        return [(0, len(sizes))]
    target = total / parts
    bounds: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for i, s in enumerate(sizes):
        acc += sum(s)
        if acc >= target * (len(bounds) + 1) and len(bounds) < parts - 1:
            bounds.append((lo, i + 1))
            lo = i + 1
    if lo < len(sizes):
        bounds.append((lo, len(sizes)))
    return bounds


class ChecksummedBackend(Backend):
    """``inner`` with a checksum trailer on every value (see the module)."""

    def __init__(self, inner: Backend, *, threads: int = 2) -> None:
        self.inner = inner
        self.name = inner.name
        self._arena = _Arena(inner)
        self._threads = threads
        self._in_thread = BlockingCalls("checksum hasher", "checksum", threads)
        self.corrupt = 0
        """Blocks whose bytes failed their checksum on a load, since start."""

    async def _split(self, fn: Any, n: int, sizes: Pieces, *args: Sequence[Any]) -> list[Any]:
        """``fn(*args)`` over the ``n`` items of ``args``, cut into one run of about equal
        bytes per thread, the runs at once; their results in order."""
        runs = _runs(sizes, self._threads) if n > 1 else [(0, n)]
        parts = await asyncio.gather(
            *(self._in_thread(fn, *(a[lo:hi] for a in args)) for lo, hi in runs)
        )
        return [x for part in parts for x in (part or [])]

    @staticmethod
    def _seal(keys: Sequence[str], ptrs: Pieces, sizes: Pieces, slots: Sequence[int]) -> None:
        for k, p, s, slot in zip(keys, ptrs, sizes, slots, strict=True):
            ctypes.c_uint64.from_address(slot).value = digest(k.encode(), p, s)

    @staticmethod
    def _check(
        keys: Sequence[str],
        ptrs: Pieces,
        sizes: Pieces,
        slots: Sequence[int],
        statuses: list[KeyStatus],
    ) -> list[KeyStatus]:
        return [
            KeyStatus.CORRUPT
            if st is KeyStatus.OK
            and digest(k.encode(), p, s) != ctypes.c_uint64.from_address(slot).value
            else st
            for k, p, s, slot, st in zip(keys, ptrs, sizes, slots, statuses, strict=True)
        ]

    @staticmethod
    def _with_trailers(
        ptrs: Pieces, sizes: Pieces, slots: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        return (
            [[*p, slot] for p, slot in zip(ptrs, slots, strict=True)],
            [[*s, TRAILER] for s in sizes],
        )

    async def _pipelined(
        self,
        keys: Sequence[str],
        ptrs: Pieces,
        sizes: Pieces,
        chunk: Callable[[Sequence[str], Pieces, Pieces, Sequence[int]], Awaitable[list[KeyStatus]]],
        limit: int,
    ) -> list[KeyStatus]:
        """``chunk(keys, ptrs, sizes, trailer slots)`` over the batch's chunks of about
        ``limit`` bytes at once, with trailer slots held until every chunk returned."""
        slots = await self._arena.take(len(keys))
        try:
            parts = await asyncio.gather(
                *(
                    chunk(keys[lo:hi], ptrs[lo:hi], sizes[lo:hi], slots[lo:hi])
                    for lo, hi in _chunks(sizes, limit)
                )
            )
        finally:
            self._arena.give(slots)
        return [st for part in parts for st in part]

    async def put(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, overwrite: bool = False
    ) -> list[KeyStatus]:
        async def chunk(k: Sequence[str], p: Pieces, s: Pieces, t: Slots) -> list[KeyStatus]:
            await self._split(self._seal, len(k), s, k, p, s, t)
            return await self.inner.put(k, *self._with_trailers(p, s, t), overwrite=overwrite)

        return await self._pipelined(keys, ptrs, sizes, chunk, CHUNK_BYTES) if keys else []

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if not keys:
            return []
        slots = await self._arena.take(len(keys))

        def verify(lo: int, hi: int, statuses: list[KeyStatus]) -> list[KeyStatus]:
            out = self._check(keys[lo:hi], ptrs[lo:hi], sizes[lo:hi], slots[lo:hi], statuses)
            return check(lo, hi, out) if check and KeyStatus.OK in out else out

        try:
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
            await self._in_thread.close()
            await self.inner.close()
