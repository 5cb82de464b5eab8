"""The backend contract: one batched async interface every storage backend implements.

Threading: an adapter owns a bounded thread pool and runs the native client's blocking
batch calls there (the native calls release the GIL), so its coroutines never block the
actor's event loop. Several batches may be in flight at once.

Error granularity:
- per key: the outcome of each key of a batch is a :class:`KeyStatus` in the returned
  list (missing key, pool full, transfer failed, ...). Native return codes never escape
  an adapter.
- per batch: when the backend as a whole cannot serve (server unreachable, client not set
  up, call timed out) the coroutine raises
  :class:`~kvray.errors.BackendUnavailableError`.

Write semantics are explicit: ``put(..., overwrite=False)`` is first-write-wins (an
existing key keeps its bytes and reports ``OK``); ``overwrite=True`` replaces it. A key
is stored whole or not at all: a failed key is absent, never half-written.

Memory: ``put`` reads and ``get`` writes raw addresses given as ``(ptr, size)`` pieces
per key; addresses must lie in memory registered with :meth:`register_region`.

Verification: ``get(..., check=...)`` runs ``check`` on the adapter's I/O thread right
after each group of keys (about :data:`CHECK_GROUP_BYTES`) landed, while their bytes are
still in the core's cache (the block checksums, :mod:`kvray.backends.checksum`);
``put(..., seal=...)`` runs ``seal`` on that thread right before each group moves, so the
native call copies bytes the digests just brought into cache.
"""

from __future__ import annotations

import abc
import ctypes
import enum
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Pieces = Sequence[Sequence[int]]
"""Per key, the addresses (or sizes) of its pieces, in order."""


class _Memory:
    """Bytes at an address as numpy sees them (``__array_interface__``): no copy, and no
    ctypes array type per call."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.__array_interface__ = {
            "data": (addr, False),
            "shape": shape,
            "strides": strides,
            "typestr": "|u1",
            "version": 3,
        }


def _runs(ptrs: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """A key's pieces as runs of one size at one stride, apart (a block's per-layer
    pieces in vLLM's KV cache; the checksum's trailer a run of its own):
    ``(first piece, pieces, stride)``."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(ptrs)
    while i < n:
        j = i + 1
        if j < n and sizes[j] == sizes[i] and ptrs[j] - ptrs[i] >= sizes[i]:
            step = ptrs[j] - ptrs[i]
            while j < n and sizes[j] == sizes[i] and ptrs[j] - ptrs[j - 1] == step:
                j += 1
        else:
            step = sizes[i]
        runs.append((i, j - i, step))
        i = j
    return runs


def gather_pieces(dst: int, ptrs: Sequence[int], sizes: Sequence[int]) -> None:
    """One key's pieces, in order, into the contiguous value at ``dst``: one strided copy
    (numpy, GIL released) per run of pieces of one size at one stride, one ``memmove``
    per other piece."""
    _copy(dst, ptrs, sizes, into_value=True)


def scatter_pieces(src: int, ptrs: Sequence[int], sizes: Sequence[int]) -> None:
    """The contiguous value at ``src`` out into one key's pieces, in order (as
    :func:`gather_pieces`)."""
    _copy(src, ptrs, sizes, into_value=False)


def _copy(value: int, ptrs: Sequence[int], sizes: Sequence[int], *, into_value: bool) -> None:
    """One numpy copy (GIL released) per run of pieces (:func:`_runs`), one ``memmove``
    per lone piece."""
    at = value
    for i, count, step in _runs(ptrs, sizes) if len(ptrs) > 1 else [(0, 1, sizes[0])]:
        size = sizes[i]
        if count == 1:
            if into_value:
                ctypes.memmove(at, ptrs[i], size)
            else:
                ctypes.memmove(ptrs[i], at, size)
        else:
            flat = np.asarray(_Memory(at, (count, size), (size, 1)))
            pieces = np.asarray(_Memory(ptrs[i], (count, size), (step, 1)))
            if into_value:
                np.copyto(flat, pieces)
            else:
                np.copyto(pieces, flat)
        at += count * size


class Check(Protocol):
    """A load's verification: ``check(lo, hi, statuses)`` for keys ``lo:hi`` of the batch
    whose native get just returned ``statuses``; returns them verified (``CORRUPT`` for a
    key whose bytes fail). Blocking; called on the thread that moved the bytes, right
    after.

    An adapter that copies each key's value out of the backend's memory itself (the
    datasystem's host path) calls :meth:`in_value` before the copy instead."""

    def __call__(self, lo: int, hi: int, statuses: list[KeyStatus]) -> list[KeyStatus]: ...

    def in_value(self, i: int, value: int, nbytes: int) -> bool:
        """Whether key ``i``'s value at ``value`` (``nbytes``, its trailer the last bytes),
        as the backend holds it, matches its trailer: one digest over contiguous memory.
        A value that does not is reported ``CORRUPT`` and not copied out."""
        ...


class Seal(Protocol):
    """A put's sealing: ``seal(lo, hi)`` writes what keys ``lo:hi`` of the batch store beside
    their bytes (their checksum trailers), computed from those bytes. Blocking; called on the
    thread that moves the bytes, right before they move (a native call's group), so that the
    bytes it read are still in that core's cache when they are copied.

    An adapter that copies each key's pieces into one contiguous value itself (the
    datasystem's host path) calls :meth:`in_value` after the copy instead."""

    def __call__(self, lo: int, hi: int) -> None: ...

    def in_value(self, i: int, value: int, nbytes: int) -> None:
        """Key ``i``'s value, copied whole to ``value`` (``nbytes``, its trailer the last
        bytes): the trailer written there from the bytes before it, in one digest over
        contiguous memory (xxhash releases the GIL only over 64 KiB, which a key's
        per-layer pieces often are not), of the bytes as stored."""
        ...


CHECK_GROUP_BYTES = 4 << 20
"""Keys are moved and checked (or sealed) in groups of about this many bytes: a group's
digests run right after (before) its native call, on the same thread, before the next
group moves. Measured on
2 cores (``scripts/bench_store.py --blocks 28 --block-kib 2048``, paired medians): the
verification of a 56 MiB hit costs +4.3 ms this way against +8.9 ms when every chunk's
digests ran on threads of their own after the chunk landed; groups of 1-64 MiB measured
alike within the noise (a scratch run: +3.3 to +5.3 ms)."""


SEAL_GROUP_BYTES = 16 << 20
"""A sealed put moves its keys in groups of about this many bytes (see :data:`Seal`).
Measured on 2 cores (Mooncake, 400 x 512 KiB, 4 I/O threads, in-process): groups of 4 MiB
left the blocks laid out so that their later gets took ~15 % longer (40 against 35 ms)
than after one call per thread; 16 MiB and 32 MiB read back as fast, 1 MiB slowed the
puts too."""


def groups(sizes: Pieces, lo: int, hi: int, *, seal: bool = False) -> list[tuple[int, int]]:
    """``[a, b)`` runs of consecutive keys of ``lo:hi``, of about :data:`CHECK_GROUP_BYTES`
    each (:data:`SEAL_GROUP_BYTES` with ``seal``)."""
    limit = SEAL_GROUP_BYTES if seal else CHECK_GROUP_BYTES
    out, a, acc = [], lo, 0
    for i in range(lo, hi):
        acc += sum(sizes[i])
        if acc >= limit:
            out.append((a, i + 1))
            a, acc = i + 1, 0
    if a < hi:
        out.append((a, hi))
    return out


def unique_rounds(keys: Sequence[str]) -> list[list[int]]:
    """The indices of ``keys`` in rounds where each key appears once: first occurrences,
    then second ones, ...; ``[[0, 1, ..., n-1]]`` when no key repeats."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for i, key in enumerate(keys):
        r = seen.get(key, 0)
        seen[key] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return rounds or [[]]


class KeyStatus(enum.Enum):
    """Outcome of one key in a batch."""

    OK = "ok"
    NOT_FOUND = "not_found"
    """get: the key is absent (never stored, evicted, or its owner left)."""
    POOL_FULL = "pool_full"
    """put: no space; the key was not written."""
    BUSY = "busy"
    """remove: the key is leased by a reader; retry later or force."""
    TRANSFER_FAILED = "transfer_failed"
    """bytes did not move (peer gone, lease expired, ...); destination must not be used."""
    SIZE_MISMATCH = "size_mismatch"
    """get: the stored object's size differs from the destination's."""
    CORRUPT = "corrupt"
    """get: the bytes arrived but fail the block's checksum; the destination must not be
    used (the block is removed from the pool)."""
    INVALID = "invalid"
    """the backend rejected the key or arguments."""
    ERROR = "error"
    """any other backend failure for this key."""


class Backend(abc.ABC):
    """A storage backend client, owned by one BackendClient (or Lookup) actor."""

    name: str = "backend"

    @abc.abstractmethod
    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are present. A per-key backend error reads as absent."""

    @abc.abstractmethod
    async def put(
        self,
        keys: Sequence[str],
        ptrs: Pieces,
        sizes: Pieces,
        *,
        overwrite: bool = False,
        seal: Seal | None = None,
    ) -> list[KeyStatus]:
        """Store each key from its pieces (concatenated in order); with ``seal``, every
        key is sealed before its bytes move (see :data:`Seal`)."""

    @abc.abstractmethod
    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        """Read each key into its pieces; ``OK`` only if every byte arrived (and, with
        ``check``, passed it: see :data:`Check`)."""

    @abc.abstractmethod
    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        """Remove keys; ``NOT_FOUND`` for absent ones, ``BUSY`` for leased ones."""

    @abc.abstractmethod
    async def register_region(self, ptr: int, size: int) -> None:
        """Make ``[ptr, ptr+size)`` usable for zero-copy transfers."""

    @abc.abstractmethod
    async def unregister_region(self, ptr: int) -> None:
        """Undo :meth:`register_region`."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """Whether the client can reach its servers right now."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """Static facts for status output (segment name, sizes, server address)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the client; further calls raise BackendUnavailableError."""
