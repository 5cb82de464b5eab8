"""Prefix lookup: how many leading blocks of a request are in the pool for ALL ranks of
an engine instance. The logic of the Lookup actor, testable without Ray.

A lookup is one ``exists`` call over ``blocks x ranks`` keys (one master round trip).
On Mooncake the same call grants each present key a read lease
(``--default_kv_lease_ttl``), which is what pins a hit until it is loaded. A lookup
slower than its timeout, or one the backend fails, is a miss: it is counted and logged
once, never raised to the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np

from kvray.backends.base import Backend
from kvray.errors import BackendError
from kvray.keys import KeySpace
from kvray.stats import RankStats

logger = logging.getLogger(__name__)


def leading_hits(present: Sequence[bool], num_blocks: int, world_size: int) -> int:
    """Leading blocks present in every rank; ``present`` is rank-major."""
    if num_blocks == 0:
        return 0
    everywhere = np.asarray(present, dtype=bool).reshape(world_size, num_blocks).all(axis=0)
    return num_blocks if everywhere.all() else int(np.argmin(everywhere))


class LookupService:
    """Answers prefix lookups against one backend client."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.stats = RankStats()
        self._warned: set[str] = set()

    async def lookup(self, space: KeySpace, hashes: Sequence[bytes], timeout_s: float) -> int:
        """Number of leading ``hashes`` stored by every rank of ``space``; 0 on timeout or
        backend failure."""
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(hashes)
        if not hashes:
            return 0
        keys = [k for r in range(space.world_size) for k in space.rank_key_strs(hashes, r)]
        try:
            present = await asyncio.wait_for(self.backend.exists(keys), timeout_s)
        except TimeoutError:
            self.stats.lookup_timeouts += 1
            self._warn_once(
                "timeout", "lookup took longer than %.0f ms: counted as a miss", timeout_s * 1e3
            )
            return 0
        except BackendError as exc:
            self.stats.lookup_errors += 1
            self._warn_once("error", "lookup failed (%s): counted as a miss", exc)
            return 0
        hits = leading_hits(present, len(hashes), space.world_size)
        self.stats.lookup_hit_blocks += hits
        return hits

    def _warn_once(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (further ones are only counted)", msg % args)
