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
from typing import NamedTuple

import numpy as np

from kvray.backends.base import Backend
from kvray.errors import BackendError
from kvray.keys import KeySpace
from kvray.ledger import Ledger, Seen, block_digest
from kvray.misses import counter
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


class Answer(NamedTuple):
    """A lookup's leading hits, and why the block after them missed (a reason of
    :mod:`kvray.misses`; empty when nothing missed)."""

    hits: int
    miss: str = ""


def first_miss(present: Sequence[bool], num_blocks: int, columns: int, hits: int) -> bool:
    """Whether the first missing block (index ``hits``) is present in some column."""
    if hits >= num_blocks:
        return False
    return any(present[c * num_blocks + hits] for c in range(columns))


LowerExists = Callable[[int, list[str]], Awaitable[list[bool]]]
"""``(rank, keys) -> present``: the SSD tier of a rank, asked for what DRAM lacks."""


class LookupService:
    """Answers prefix lookups against one backend client (and, in a ``<backend>|ssd``
    pipeline, each rank's SSD tier for the keys DRAM lacks)."""

    def __init__(
        self,
        backend: Backend,
        lower: LowerExists | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.backend = backend
        self.lower = lower
        self.ledger = ledger
        """What the pool stored and removed (a replica of the manager's): tells a
        never-stored miss from an evicted or removed one. None: every miss is
        ``not_stored``."""
        self.mixed_hashing: set[str] = set()
        """``namespace@layout`` that instances hashing blocks differently share."""
        self.stats = RankStats()
        self._warned: set[str] = set()

    async def lookup(
        self,
        space: KeySpace,
        hashes: Sequence[bytes],
        timeout_s: float,
        want: int = 0,
        wait_s: float = 0.0,
    ) -> Answer:
        """Leading ``hashes`` stored by every rank of ``space`` (0 on timeout or backend
        failure), and why the next one missed. With ``want`` > 0, asks again until that
        many lead or ``wait_s`` passed (each ask bounded by ``timeout_s``)."""
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(hashes)
        if not hashes:
            return Answer(0)
        keys = space.lookup_key_strs(hashes)
        n = len(hashes)
        want = min(want, n)
        deadline = time.monotonic() + wait_s
        while True:
            hits, from_ssd, why = await self._ask(space, keys, n, timeout_s)
            if hits >= max(want, 0) and hits >= 0:
                break
            if time.monotonic() + POLL_S > deadline:
                if hits < 0:
                    return self._missed(Answer(0, why), n)
                break
            # A slow or failed ask while waiting for a prefill is asked again: one busy
            # moment of the backend must not end the wait (seen on a loaded 2-core host:
            # the decode gave up after ~1 s of a 30 s pd_wait_ms and recomputed).
            await asyncio.sleep(POLL_S)
        self.stats.lookup_hit_blocks += hits
        self.stats.lookup_ssd_blocks += from_ssd
        return self._missed(Answer(hits, why), n)

    def _missed(self, answer: Answer, n: int) -> Answer:
        if answer.miss:
            name = counter(answer.miss)
            setattr(self.stats, name, getattr(self.stats, name) + n - answer.hits)
        return answer

    def classify(
        self, space: KeySpace, keys: list[str], n: int, present: Sequence[bool], hits: int
    ) -> str:
        """Why block ``hits`` (the first one missing) missed; see :mod:`kvray.misses`."""
        if hits >= n:
            return ""
        if first_miss(present, n, space.columns, hits):
            return "partial_ranks"
        seen = self.ledger.state(block_digest(keys[hits])) if self.ledger else Seen.NEVER
        if seen is Seen.STORED:
            return "evicted"
        if seen is Seen.REMOVED:
            return "removed"
        if f"{space.namespace}@{space.layout}" in self.mixed_hashing:
            return "other_fingerprint"
        return "not_stored"

    async def _ask(
        self, space: KeySpace, keys: list[str], n: int, timeout_s: float
    ) -> tuple[int, int, str]:
        """(leading hits, how many of them only the SSD tier has, why the next one
        missed); hits is -1 for a timed-out or failed ask (counted, logged once)."""
        try:
            present, dram = await asyncio.wait_for(
                self._present(keys, n, space.layer_groups), timeout_s
            )
        except TimeoutError:
            self.stats.lookup_timeouts += 1
            self._warn_once(
                "timeout", "lookup took longer than %.0f ms: counted as a miss", timeout_s * 1e3
            )
            return -1, 0, "lookup_timeout"
        except BackendError as exc:
            self.stats.lookup_errors += 1
            self._warn_once("error", "lookup failed (%s): counted as a miss", exc)
            return -1, 0, "lookup_error"
        hits = leading_hits(present, n, space.columns)
        why = self.classify(space, keys, n, present, hits)
        if dram is None or not hits:
            return hits, 0, why
        return hits, hits - min(leading_hits(dram, n, space.columns), hits), why

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
