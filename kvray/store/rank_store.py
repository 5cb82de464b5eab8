"""The logic of one rank's BackendClient actor, testable without Ray.

It owns the rank's backend client and the shared regions it has mapped, turns
:class:`~kvray.transfer.TransferBatch` descriptors into addresses (bounds checked here,
in the process that dereferences them) and counts what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from kvray.backends.base import Backend, KeyStatus, unique_rounds
from kvray.errors import RegionError
from kvray.shm import RegionSpec, SharedRegion
from kvray.stats import RankStats
from kvray.transfer import TransferBatch

logger = logging.getLogger(__name__)

WARM_UP_BYTES = 1 << 20
"""What :meth:`RankStore.ensure_region` stores once from a region it registered, in two
pieces (a block of an engine with layers: the backend's multi-piece path). A 4 KiB
warm-up left the first saves of the embedded-serve test at 300-400 ms."""
REGION_SWEEP_S = 2.0
"""How often mappings of regions whose creator went away are dropped: a dead engine's KV
cache is freed by the kernel only once this process unmaps it too (the check is a stat)."""


class RankStore:
    """Regions + backend + counters for one rank."""

    def __init__(self, backend: Backend, rank: int) -> None:
        self.backend = backend
        self.rank = rank
        self.stats = RankStats()
        self._regions: dict[str, SharedRegion] = {}
        self._mapping: dict[str, asyncio.Lock] = {}
        """One lock per region id ever seen (kept: dropping it could let two mappings in)."""
        self._sweeper: asyncio.Task[None] | None = None
        self._users: dict[int, int] = {}
        """Transfers running on each mapped region (by ``id`` of its mapping)."""
        self._drained: dict[int, asyncio.Event] = {}
        """Set when the last transfer on a region being released ends."""

    async def ensure_region(self, spec: RegionSpec) -> SharedRegion:
        """Map and register ``spec`` unless already done (idempotent: every batch carries
        its region, so a restarted actor re-maps on first sight)."""
        region = self._regions.get(spec.region_id)
        if region is not None and region.spec == spec:
            return region
        # Transfers run concurrently: the first ones to see a new region (a save per PP
        # stage, a load next to a save) must map and register it once, not each its own
        # copy (the one replaced would be unmapped under the other's transfer).
        async with self._mapping.setdefault(spec.region_id, asyncio.Lock()):
            region = self._regions.get(spec.region_id)
            if region is not None and region.spec == spec:
                return region
            if region is not None:
                await self.release_region(spec.region_id)
            await self.drop_stale_regions()
            # Every page mapped up front (in a thread: ~0.1 s per GiB), so that no
            # transfer pays this process's first-touch faults.
            region = await asyncio.to_thread(SharedRegion.attach, spec, populate=True)
            await self.backend.register_region(region.base_ptr, spec.size)
            await self._warm_up(region.base_ptr, min(WARM_UP_BYTES, spec.size))
            self._regions[spec.region_id] = region
            if self._sweeper is None or self._sweeper.done():  # on the actor's loop
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep_regions())
        self.stats.regions = len(self._regions)
        logger.info("rank %d mapped region %s (%d bytes)", self.rank, spec.region_id, spec.size)
        return region

    async def _warm_up(self, ptr: int, size: int) -> None:
        """One put and remove of a scratch key from a region just registered: a backend's
        first transfers set up its connections (measured on Mooncake: 50-400 ms on a busy
        2-core host, then 5-10 ms), paid here rather than by an engine's first save, which
        the same prompt sent again at once would then miss. Not counted, and not in the
        ledger or the block indexes."""
        key = f"kvray-warmup-{self.rank}-{secrets.token_hex(6)}"
        try:
            half = size // 2
            (status,) = await self.backend.put([key], [[ptr, ptr + half]], [[half, half]])
            if status is KeyStatus.OK:
                await self.backend.remove([key], force=True)
        except Exception as exc:  # noqa: BLE001 - the first save pays for it instead
            logger.info("rank %d: warm-up put failed (%s)", self.rank, exc)

    async def release_region(self, region_id: str) -> None:
        """Unregister and unmap a region once the transfers running on it ended: a
        backend thread still copying from it would fault on the unmapped pages (seen: an
        engine killed with saves in flight took its node's BackendClient down)."""
        region = self._regions.pop(region_id, None)
        if region is None:
            return
        if self._users.get(id(region)):
            await self._drained.setdefault(id(region), asyncio.Event()).wait()
        await self.backend.unregister_region(region.base_ptr)
        region.close()
        self.stats.regions = len(self._regions)

    async def drop_stale_regions(self) -> None:
        """Unmap regions whose owner removed the file or died (idempotent)."""
        for region_id in [r for r, reg in self._regions.items() if reg.stale()]:
            logger.info("rank %d drops region %s: its owner is gone", self.rank, region_id)
            await self.release_region(region_id)

    async def _sweep_regions(self) -> None:
        """Reconcile loop: each pass is idempotent and a failure only skips one pass."""
        while True:
            await asyncio.sleep(REGION_SWEEP_S)
            try:
                await self.drop_stale_regions()
            except Exception:
                logger.exception("rank %d: region sweep failed", self.rank)

    @contextlib.asynccontextmanager
    async def _addresses(
        self, batch: TransferBatch
    ) -> AsyncIterator[tuple[list[list[int]], list[list[int]]]]:
        """The batch's addresses, valid until the block ends: its region stays mapped
        until then (:meth:`release_region` waits)."""
        region = await self.ensure_region(batch.region)
        if len(batch) and int((batch.offsets + batch.lengths).max()) > region.spec.size:
            raise RegionError(f"descriptor outside region {batch.region.region_id}")
        ptrs: list[list[int]] = (batch.offsets + region.base_ptr).tolist()
        sizes: list[list[int]] = batch.lengths.tolist()
        key = id(region)
        self._users[key] = self._users.get(key, 0) + 1
        try:
            yield ptrs, sizes
        finally:
            left = self._users.pop(key) - 1
            if left:
                self._users[key] = left
            elif (drained := self._drained.pop(key, None)) is not None:
                drained.set()

    async def _each_once(
        self,
        op: Callable[[list[str], list[list[int]], list[list[int]]], Awaitable[list[KeyStatus]]],
        keys: Sequence[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
    ) -> list[KeyStatus]:
        """``op`` over the batch with every key at most once per native call: a key
        repeats in a batch when two requests of one engine step share a prefix, and
        Mooncake's ``batch_get_into`` then fills only one of its destinations while it
        reports every one OK (measured: the others keep their old bytes). Rounds run one
        after the other; a batch without repeats is one call, as before."""
        rounds = unique_rounds(keys)
        if len(rounds) == 1:
            return await op(list(keys), ptrs, sizes)
        out: list[KeyStatus] = [KeyStatus.ERROR] * len(keys)
        for idx in rounds:
            sub = await op([keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx])
            for i, status in zip(idx, sub, strict=True):
                out[i] = status
        return out

    async def put(self, batch: TransferBatch, *, overwrite: bool = False) -> list[KeyStatus]:
        put = functools.partial(self.backend.put, overwrite=overwrite)
        async with self._addresses(batch) as (ptrs, sizes):
            statuses = await self._each_once(put, batch.keys, ptrs, sizes)
        ok = np.fromiter((s is KeyStatus.OK for s in statuses), dtype=bool, count=len(statuses))
        self.stats.put_keys += int(ok.sum())
        self.stats.put_bytes += int(batch.key_nbytes()[ok].sum()) if len(batch) else 0
        full = sum(s is KeyStatus.POOL_FULL for s in statuses)
        self.stats.put_pool_full += full
        self.stats.put_failed += len(statuses) - int(ok.sum()) - full
        return statuses

    async def get(self, batch: TransferBatch) -> list[KeyStatus]:
        async with self._addresses(batch) as (ptrs, sizes):
            statuses = await self._each_once(self.backend.get, batch.keys, ptrs, sizes)
        ok = np.fromiter((s is KeyStatus.OK for s in statuses), dtype=bool, count=len(statuses))
        missed = sum(s is KeyStatus.NOT_FOUND for s in statuses)
        corrupt = sum(s is KeyStatus.CORRUPT for s in statuses)
        self.stats.get_keys += int(ok.sum())
        self.stats.get_bytes += int(batch.key_nbytes()[ok].sum()) if len(batch) else 0
        self.stats.get_missed += missed
        self.stats.get_corrupt += corrupt
        self.stats.get_failed += len(statuses) - int(ok.sum()) - missed - corrupt
        return statuses

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.backend.exists(keys)

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        statuses = await self.backend.remove(keys, force=force)
        self.stats.removed += sum(s is KeyStatus.OK for s in statuses)
        return statuses

    def snapshot(self) -> dict[str, Any]:
        return {"rank": self.rank, "info": self.backend.info(), "stats": self.stats.to_dict()}

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for region_id in list(self._regions):
            await self.release_region(region_id)
        await self.backend.close()
