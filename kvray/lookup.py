"""Prefix lookup: how many leading blocks of a request are in the pool for ALL ranks of
an engine instance. The logic of the Lookup actor, testable without Ray.

A lookup is one ``exists`` call over ``blocks x ranks`` keys (one master round trip).
On Mooncake the same call grants each present key a read lease
(``--default_kv_lease_ttl``), which is what pins a hit until it is loaded. A lookup
slower than its timeout, or one the backend fails, is a miss: it is counted and logged
once, never raised to the scheduler.

A lookup may also wait (PD disaggregation): given ``want`` leading blocks a prefill
instance reported stored, it asks the backend again every ``POLL_S`` until they are all
there or ``wait_s`` passed. Waiting here, in one cheap coroutine, keeps the engine from
spinning empty steps while a prefill's last saves land.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from kvray.backends.base import Backend
from kvray.errors import BackendError
from kvray.keys import KeySpace
from kvray.stats import RankStats

logger = logging.getLogger(__name__)


def leading_hits(present: Sequence[bool], num_blocks: int, columns: int) -> int:
    """Leading blocks present in every column (rank, and layer group when layer-wise);
    ``present`` is column-major."""
    if num_blocks == 0:
        return 0
    everywhere = np.asarray(present, dtype=bool).reshape(columns, num_blocks).all(axis=0)
    return num_blocks if everywhere.all() else int(np.argmin(everywhere))


POLL_S = 0.01
"""How often a waiting lookup asks the backend again."""

LowerTier = Callable[[int, list[str]], Awaitable[list[bool]]]
"""``(rank, keys) -> present``: the SSD tier of a rank, asked for what DRAM lacks."""


class LookupService:
    """Answers prefix lookups against one backend client (and, in a ``<backend>|ssd``
    pipeline, each rank's SSD tier for the keys DRAM lacks)."""

    def __init__(self, backend: Backend, lower: LowerTier | None = None) -> None:
        self.backend = backend
        self.lower = lower
        self.stats = RankStats()
        self._warned: set[str] = set()

    async def lookup(
        self,
        space: KeySpace,
        hashes: Sequence[bytes],
        timeout_s: float,
        want: int = 0,
        wait_s: float = 0.0,
    ) -> int:
        """Number of leading ``hashes`` stored by every rank of ``space``; 0 on timeout or
        backend failure. With ``want`` > 0, asks again until that many lead or ``wait_s``
        passed (each ask bounded by ``timeout_s``)."""
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(hashes)
        if not hashes:
            return 0
        keys = space.lookup_key_strs(hashes)
        want = min(want, len(hashes))
        deadline = time.monotonic() + wait_s
        while True:
            hits, from_ssd = await self._ask(space, keys, len(hashes), timeout_s)
            if hits >= max(want, 0) and hits >= 0:
                break
            if time.monotonic() + POLL_S > deadline:
                if hits < 0:
                    return 0
                break
            # A slow or failed ask while waiting for a prefill is asked again: one busy
            # moment of the backend must not end the wait (seen on a loaded 2-core host:
            # the decode gave up after ~1 s of a 30 s pd_wait_ms and recomputed).
            await asyncio.sleep(POLL_S)
        self.stats.lookup_hit_blocks += hits
        self.stats.lookup_ssd_blocks += from_ssd
        return hits

    async def _ask(
        self, space: KeySpace, keys: list[str], n: int, timeout_s: float
    ) -> tuple[int, int]:
        """(leading hits, how many of them only the SSD tier has); hits is -1 for a
        timed-out or failed ask (counted, logged once)."""
        try:
            present, dram = await asyncio.wait_for(
                self._present(keys, n, space.layer_groups), timeout_s
            )
        except TimeoutError:
            self.stats.lookup_timeouts += 1
            self._warn_once(
                "timeout", "lookup took longer than %.0f ms: counted as a miss", timeout_s * 1e3
            )
            return -1, 0
        except BackendError as exc:
            self.stats.lookup_errors += 1
            self._warn_once("error", "lookup failed (%s): counted as a miss", exc)
            return -1, 0
        hits = leading_hits(present, n, space.columns)
        if dram is None or not hits:
            return hits, 0
        return hits, hits - min(leading_hits(dram, n, space.columns), hits)

    async def _present(
        self, keys: list[str], n: int, groups: int = 1
    ) -> tuple[list[bool], list[bool] | None]:
        """Presence in any tier, and in DRAM alone (None when no lower tier was asked).
        ``keys`` are ``n`` per column, ``groups`` columns per rank."""
        present = await self.backend.exists(keys)
        if self.lower is None or all(present):
            return present, None
        per_rank = n * groups
        ranks = len(keys) // per_rank if n else 0
        asks = {
            r: [i for i in range(r * per_rank, (r + 1) * per_rank) if not present[i]]
            for r in range(ranks)
        }
        asks = {r: idx for r, idx in asks.items() if idx}
        answers = await asyncio.gather(
            *(self.lower(r, [keys[i] for i in idx]) for r, idx in asks.items())
        )
        merged = list(present)
        for idx, got in zip(asks.values(), answers, strict=True):
            for i, p in zip(idx, got, strict=True):
                merged[i] = merged[i] or p
        return merged, present

    def _warn_once(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (further ones are only counted)", msg % args)
