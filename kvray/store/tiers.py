"""One rank's tiers: the DRAM backend, then (pipeline ``<backend>|ssd``) the SSD tier
below it. The logic of the BackendClient actor, testable without Ray.

Writes go through to both tiers at once and count as stored when either tier stored
them; reads try DRAM first and ask the lower tier only for the keys DRAM could not
serve (missing, a failed transfer, or a block that failed its checksum: the lower
tier rewrites every byte of the destination). The lower tier is anything with the
:class:`LowerTier` methods: the SSD offload actor of the same node and slot (through
:class:`RemoteTier`), or a :class:`~kvray.store.rank_store.RankStore` in the same process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from kvray.backends.base import KeyStatus
from kvray.index.ledger import Changes, Seen, block_digest
from kvray.index.stream import OP_ADD, OP_GONE, OP_REMOVE
from kvray.remote import StoreHandle
from kvray.shm import RegionSpec
from kvray.stats import RankStats
from kvray.store.rank_store import RankStore
from kvray.transfer import TransferBatch

LOWER_TIER_SERVES = (KeyStatus.NOT_FOUND, KeyStatus.TRANSFER_FAILED, KeyStatus.CORRUPT)
_GONE = (KeyStatus.NOT_FOUND, KeyStatus.CORRUPT)
"""Outcomes after which a tier no longer holds the key (a corrupt block is removed)."""
"""DRAM outcomes the lower tier may still turn into a hit (it rewrites every byte)."""


class LowerTier(Protocol):
    """The tier below DRAM: the rank's own store's contract (:class:`RankStore` has it)."""

    async def put(self, batch: TransferBatch, *, overwrite: bool = False) -> list[KeyStatus]: ...
    async def get(self, batch: TransferBatch) -> list[KeyStatus]: ...
    async def exists(self, keys: Sequence[str]) -> list[bool]: ...
    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]: ...
    async def ensure_region(self, spec: RegionSpec) -> object: ...
    async def release_region(self, region_id: str) -> None: ...


class RemoteTier:
    """The SSD offload actor as the lower tier; every call bounded by ``timeout_s``
    (its failure is a :class:`~kvray.errors.KVRayError` the caller sees)."""

    def __init__(self, handle: StoreHandle, timeout_s: float) -> None:
        self.handle = handle
        self._timeout_s = timeout_s

    async def put(self, batch: TransferBatch, *, overwrite: bool = False) -> list[KeyStatus]:
        return await self.handle.put(batch, overwrite).aresult(self._timeout_s)

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        return await self.handle.get(batch).aresult(self._timeout_s)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.handle.exists(keys).aresult(self._timeout_s)

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        return await self.handle.remove(keys, force).aresult(self._timeout_s)

    async def ensure_region(self, spec: RegionSpec) -> None:
        await self.handle.map_region(spec).aresult(self._timeout_s)

    async def release_region(self, region_id: str) -> None:
        await self.handle.release_region(region_id).aresult(self._timeout_s)


def _either(upper: Sequence[KeyStatus], lower: Sequence[KeyStatus]) -> list[KeyStatus]:
    """Per key: OK when either tier did it, else the DRAM tier's outcome."""
    return [
        KeyStatus.OK if KeyStatus.OK in (d, s) else d for d, s in zip(upper, lower, strict=True)
    ]


IndexKeys = list[tuple[int, bool, list[str]]]
"""``(OP_ADD, OP_REMOVE or OP_GONE, the lower tier?, keys)``: what the tiers took or let
go, for the nodes' block indexes (kvray/index/stream.py)."""


class TieredStore:
    """DRAM (``dram``) over an optional ``lower`` tier, counting into ``dram.stats``;
    remembers what it stored and removed for the pool's ledger (:meth:`take_changes`).
    A call given an ``index`` list adds to it, per tier, what the call stored and removed
    and the keys it found gone (evicted since), for the nodes' block indexes."""

    def __init__(self, dram: RankStore, lower: LowerTier | None = None) -> None:
        self.dram = dram
        self.lower = lower
        self._changes: list[Changes] = []

    @property
    def stats(self) -> RankStats:
        return self.dram.stats

    def take_changes(self) -> Changes:
        """Blocks stored or removed since the last call."""
        changes, self._changes = self._changes, []
        return Changes.join(changes)

    @staticmethod
    def _note_index(
        index: IndexKeys | None,
        op: int,
        lower: bool,
        keys: Sequence[str],
        statuses: Sequence[KeyStatus],
        *of: KeyStatus,
    ) -> None:
        if index is None:
            return
        picked = [k for k, s in zip(keys, statuses, strict=True) if s in of]
        if picked:
            index.append((op, lower, picked))

    def _note(self, keys: Sequence[str], statuses: Sequence[KeyStatus], what: Seen) -> None:
        done = [block_digest(k) for k, s in zip(keys, statuses, strict=True) if s is KeyStatus.OK]
        if done:
            self._changes.append(Changes.of(done, what, time.time()))

    async def put(
        self, batch: TransferBatch, overwrite: bool = False, *, index: IndexKeys | None = None
    ) -> list[KeyStatus]:
        if self.lower is None:
            statuses = await self.dram.put(batch, overwrite=overwrite)
            self._note_index(index, OP_ADD, False, batch.keys, statuses, KeyStatus.OK)
        else:
            # Write-through to both tiers at once; the caller may reuse its memory when
            # this returns, so the lower tier's write is awaited too.
            dram, lower = await asyncio.gather(
                self.dram.put(batch, overwrite=overwrite),
                self.lower.put(batch, overwrite=overwrite),
            )
            self.dram.stats.ssd_put_keys += sum(s is KeyStatus.OK for s in lower)
            statuses = _either(dram, lower)
            self._note_index(index, OP_ADD, False, batch.keys, dram, KeyStatus.OK)
            self._note_index(index, OP_ADD, True, batch.keys, lower, KeyStatus.OK)
        self._note(batch.keys, statuses, Seen.STORED)
        return statuses

    async def get(self, batch: TransferBatch, *, index: IndexKeys | None = None) -> list[KeyStatus]:
        statuses = await self.dram.get(batch)
        # Keys a load found gone (evicted since they were stored) or removed as corrupt.
        self._note_index(index, OP_GONE, False, batch.keys, statuses, *_GONE)
        if self.lower is None:
            return statuses
        misses = [i for i, s in enumerate(statuses) if s in LOWER_TIER_SERVES]
        if misses:
            sub = batch.take(misses)
            lower = await self.lower.get(sub)
            self._note_index(index, OP_GONE, True, sub.keys, lower, *_GONE)
            nbytes = sub.key_nbytes()
            for j, (i, s) in enumerate(zip(misses, lower, strict=True)):
                if s is KeyStatus.OK:
                    statuses[i] = KeyStatus.OK
                    self.dram.stats.ssd_get_keys += 1
                    self.dram.stats.ssd_get_bytes += int(nbytes[j])
        return statuses

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        present = await self.dram.exists(keys)
        if self.lower is None or all(present):
            return present
        lower = await self.lower.exists(list(keys))
        return [a or b for a, b in zip(present, lower, strict=True)]

    async def remove(
        self, keys: Sequence[str], force: bool = False, *, index: IndexKeys | None = None
    ) -> list[KeyStatus]:
        statuses = await self.dram.remove(keys, force=force)
        self._note_index(index, OP_REMOVE, False, keys, statuses, *_GONE, KeyStatus.OK)
        if self.lower is not None:
            lower = await self.lower.remove(list(keys), force=force)
            self._note_index(index, OP_REMOVE, True, keys, lower, *_GONE, KeyStatus.OK)
            statuses = _either(statuses, lower)
        self._note(keys, statuses, Seen.REMOVED)
        return statuses

    async def map_region(self, spec: RegionSpec) -> None:
        await self.dram.ensure_region(spec)
        if self.lower is not None:
            await self.lower.ensure_region(spec)

    async def release_region(self, region_id: str) -> None:
        await self.dram.release_region(region_id)
        if self.lower is not None:
            await self.lower.release_region(region_id)
