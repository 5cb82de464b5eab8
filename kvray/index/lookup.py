"""Prefix lookup: how many leading blocks of a request are in the pool for ALL ranks of
an engine instance. The logic of the Lookup actor, testable without Ray.

A lookup is one ``exists`` call over ``blocks x ranks`` keys (one master round trip).
On Mooncake the same call grants each present key a read lease
(``--default_kv_lease_ttl``), which is what pins a hit until it is loaded. A lookup
slower than its timeout, or one the backend fails, is a miss: it is counted and logged
once, never raised to the scheduler.

With a ``<backend>|ssd`` pipeline, the keys DRAM lacks are asked of the SSD tier, per key
column, of the worker that loads that column: its node and local slot (the instance's
:data:`Placement`, which its workers name in vLLM's handshake metadata and its scheduler
sends with each lookup). A block is a hit only where the loading worker's own tier holds
it: another node's disk, or another slot's directory, is not one it reads.

A lookup may also wait (PD disaggregation): given ``want`` leading blocks a prefill
instance reported stored, it asks the backend again every ``POLL_S`` until they are all
there or ``wait_s`` passed. Waiting here, in one cheap coroutine, keeps the engine from
spinning empty steps while a prefill's last saves land.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from kvray.backends.base import Backend
from kvray.errors import BackendError, KVRayError
from kvray.index.ledger import Ledger, Seen, block_digest
from kvray.keys import KeySpace
from kvray.misses import counter
from kvray.stats import RankStats
from kvray.warn_once import WarnOnce

logger = logging.getLogger(__name__)


def leading_hits(present: Sequence[bool] | np.ndarray, num_blocks: int, columns: int) -> int:
    """Leading blocks present in every column (rank, and layer group when layer-wise);
    ``present`` is column-major."""
    if num_blocks == 0:
        return 0
    everywhere = np.asarray(present, dtype=bool).reshape(columns, num_blocks).all(axis=0)
    return num_blocks if everywhere.all() else int(np.argmin(everywhere))


def servable_hits(present: Sequence[bool] | np.ndarray, num_blocks: int, space: KeySpace) -> int:
    """Leading blocks the instance of ``space`` can load: :func:`leading_hits` of every
    column, or, with state groups (a hybrid model's Mamba or linear-attention groups), the
    deepest ``h`` such that every other column holds blocks ``0..h-1`` and every state
    column holds block ``h - 1`` (the state at the hit's end): vLLM's own rule for such
    models, a fixed point, not each group's longest hit."""
    if not space.state_groups:
        return leading_hits(present, num_blocks, space.columns)
    if num_blocks == 0:
        return 0
    held = np.asarray(present, dtype=bool).reshape(space.columns, num_blocks)
    state = np.array(space.state_columns())
    others = held[~state].all(axis=0)
    lead = num_blocks if others.all() else int(np.argmin(others))
    ends = np.nonzero(held[state].all(axis=0)[:lead])[0]
    return int(ends[-1]) + 1 if len(ends) else 0


POLL_S = 0.01
"""How often a waiting lookup asks the backend again."""


class Answer(NamedTuple):
    """A lookup's leading hits, and why the block after them missed (a reason of
    :mod:`kvray.misses`; empty when nothing missed)."""

    hits: int
    miss: str = ""
    ssd: int = 0
    """Of the hits, how many only the SSD tier holds (some column not in DRAM)."""


class Why(NamedTuple):
    """A lookup as the Pool API answers it: ``(hits, reason)`` (:meth:`Pool.lookup_why`)."""

    hits: int
    miss: str = ""


def first_miss(present: Sequence[bool], num_blocks: int, columns: int, hits: int) -> bool:
    """Whether the first missing block (index ``hits``) is present in some column."""
    if hits >= num_blocks:
        return False
    return any(present[c * num_blocks + hits] for c in range(columns))


class Place(NamedTuple):
    """Where an engine worker loads through: its node and local slot, whose BackendClient
    (and SSD offload actor) it uses."""

    node_id: str
    slot: int


Placement = Mapping[int, Place]
"""An instance's workers: instance rank (``pp_rank * tp_size + tp_rank``, as its keys
name it) -> the place of the worker that loads that rank's key columns."""


def ssd_places(
    ranks: int | Sequence[int], placement: Placement | None, own_node: str
) -> list[Place | None]:
    """Per instance rank (``ranks`` of them, or those listed), the SSD tier a lookup asks
    for that rank's columns. Placement unknown (None: a Pool API caller, or an engine
    whose workers did not name it): this node's slot ``rank``, where a one-node
    instance's workers run. Known: the place its worker named; a rank without one has
    nothing on SSD that its worker could load (None)."""
    listed = range(ranks) if isinstance(ranks, int) else ranks
    if placement is None:
        return [Place(own_node, r) for r in listed]
    return [placement.get(r) for r in listed]


LowerExists = Callable[[Place, list[str]], Awaitable[list[bool]]]
"""``(place, keys) -> present``: the SSD tier of a node's slot, asked for what DRAM
lacks. No tier there: all False."""


class LookupService:
    """Answers prefix lookups against one backend client (and, in a ``<backend>|ssd``
    pipeline, the SSD tier each rank's worker loads through, for the keys DRAM lacks)."""

    def __init__(
        self,
        backend: Backend,
        lower: LowerExists | None = None,
        ledger: Ledger | None = None,
        node_id: str = "",
    ) -> None:
        """``node_id``: the node this service runs on (the SSD tiers a lookup without a
        placement asks)."""
        self.backend = backend
        self.lower = lower
        self.node_id = node_id
        self.ledger = ledger
        """What the pool stored and removed (a replica of the manager's): tells a
        never-stored miss from an evicted or removed one. None: every miss is
        ``not_stored``."""
        self.mixed_hashing: set[str] = set()
        """``namespace@layout`` that instances hashing blocks differently share."""
        self.stats = RankStats()
        self.ssd_asks: Counter[Place] = Counter()
        """How often each SSD tier was asked, by node and slot (the Lookup actor's snapshot)."""
        self._warn_once = WarnOnce(logger, " (further ones are only counted)")

    async def lookup(
        self,
        space: KeySpace,
        hashes: Sequence[bytes],
        timeout_s: float,
        want: int = 0,
        wait_s: float = 0.0,
        placement: Placement | None = None,
    ) -> Answer:
        """Leading ``hashes`` stored by every rank of ``space`` (0 on timeout or backend
        failure), and why the next one missed. With ``want`` > 0, asks again until that
        many lead or ``wait_s`` passed (each ask bounded by ``timeout_s``). ``placement``:
        where each rank's worker loads through (see :func:`ssd_places`)."""
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(hashes)
        if not hashes:
            return Answer(0)
        keys = space.lookup_key_strs(hashes)
        n = len(hashes)
        want = min(want, n)
        deadline = time.monotonic() + wait_s
        while True:
            hits, from_ssd, why = await self._ask(space, keys, n, timeout_s, placement)
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
        return self._missed(Answer(hits, why, from_ssd), n)

    async def pin(self, space: KeySpace, hashes: Sequence[bytes], timeout_s: float) -> None:
        """Pin the keys of blocks about to load (a scheduler answered their lookup from
        the node's index): the same ``exists`` a lookup makes, whose answer on Mooncake
        grants each present key a read lease. Failures are counted, never raised: the
        caller does not wait, and an unpinned block only risks a failed load."""
        self.stats.pins += 1
        try:
            await asyncio.wait_for(self.backend.exists(space.lookup_key_strs(hashes)), timeout_s)
        except (TimeoutError, BackendError) as exc:
            self.stats.pin_failures += 1
            self._warn_once("pin", "pinning blocks before their load failed (%s)", exc)

    def count(self, counts: dict[str, int]) -> None:
        """Add lookup counters (:class:`RankStats` fields) counted elsewhere: the lookups
        schedulers answered from the node's block index. Unknown names are ignored."""
        for name, n in counts.items():
            if name.startswith(("lookup", "miss_")) and hasattr(self.stats, name):
                setattr(self.stats, name, getattr(self.stats, name) + int(n))
        self.stats.index_lookups += int(counts.get("lookups", 0))

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
        self,
        space: KeySpace,
        keys: list[str],
        n: int,
        timeout_s: float,
        placement: Placement | None = None,
    ) -> tuple[int, int, str]:
        """(leading hits, how many of them only the SSD tier has, why the next one
        missed); hits is -1 for a timed-out or failed ask (counted, logged once)."""
        try:
            present, dram = await asyncio.wait_for(
                self._present(keys, n, space, placement), timeout_s
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
        hits = servable_hits(present, n, space)
        why = self.classify(space, keys, n, present, hits)
        if dram is None or not hits:
            return hits, 0, why
        return hits, hits - min(servable_hits(dram, n, space), hits), why

    async def _present(
        self, keys: list[str], n: int, space: KeySpace, placement: Placement | None = None
    ) -> tuple[list[bool], list[bool] | None]:
        """Presence in any tier, and in DRAM alone (None when no lower tier was asked).
        ``keys`` are ``n`` per column of ``space``; each keyed rank's missing keys are
        asked of the SSD tier its worker loads through (one ask per place)."""
        present = await self.backend.exists(keys)
        if self.lower is None or all(present):
            return present, None
        per = space.columns // space.key_ranks
        per_rank = n * per
        ranks = [space.column(i * per)[0] for i in range(space.key_ranks)] if n else []
        asks: dict[Place, list[int]] = {}
        for r, place in enumerate(ssd_places(ranks, placement, self.node_id)):
            missing = [i for i in range(r * per_rank, (r + 1) * per_rank) if not present[i]]
            if place is not None and missing:
                asks.setdefault(place, []).extend(missing)
        self.ssd_asks.update(asks.keys())
        answers = await asyncio.gather(
            *(self._on_ssd(place, [keys[i] for i in idx]) for place, idx in asks.items())
        )
        merged = list(present)
        for idx, got in zip(asks.values(), answers, strict=True):
            for i, p in zip(idx, got, strict=True):
                merged[i] = merged[i] or p
        return merged, present

    async def _on_ssd(self, place: Place, keys: list[str]) -> list[bool]:
        """``keys`` present in the SSD tier at ``place``; a tier that fails (its node
        gone, its actor broken) holds nothing the worker there could load: all False,
        not a failed lookup (the DRAM answer and the other tiers' still count)."""
        assert self.lower is not None, "_on_ssd without a lower tier: LookupService's bug"
        try:
            return await self.lower(place, keys)
        except KVRayError as exc:
            self._warn_once(
                f"ssd:{place.node_id}:{place.slot}",
                "the SSD tier of slot %d on node %s failed (%s): its blocks count as misses",
                place.slot,
                place.node_id[:12],
                exc,
            )
            return [False] * len(keys)
