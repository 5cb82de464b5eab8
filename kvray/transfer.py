"""Transfer descriptors: the small messages of the data plane.

A :class:`TransferBatch` says "move these keys from/to these byte ranges of this shared
region". It is what crosses the Ray call; the KV bytes themselves stay in the region and
are moved by the backend's zero-copy batch calls. Every key has the same number of
pieces (one per layer where the engine keeps layers apart, else one), so the batch is
two small int64 arrays, cheap to pickle for thousands of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvray.errors import RegionError
from kvray.shm import RegionSpec


@dataclass(frozen=True)
class TransferBatch:
    """Keys and their ``(offset, length)`` pieces inside one region.

    ``offsets`` and ``lengths`` are int64 arrays of shape ``(len(keys), pieces)``.
    """

    region: RegionSpec
    keys: tuple[str, ...]
    offsets: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.keys)
        if (
            self.offsets.ndim != 2
            or self.offsets.shape != self.lengths.shape
            or self.offsets.shape[0] != n
        ):
            raise RegionError(
                f"TransferBatch: offsets {self.offsets.shape} and lengths {self.lengths.shape} "
                f"must both be ({n}, pieces)"
            )
        if n == 0:
            return
        if (self.lengths <= 0).any() or (self.offsets < 0).any():
            raise RegionError("TransferBatch: every piece needs offset >= 0 and length > 0")
        end = int((self.offsets + self.lengths).max())
        if end > self.region.size:
            raise RegionError(
                f"TransferBatch: a piece ends at byte {end}, past the end of region "
                f"{self.region.region_id} ({self.region.size} bytes)"
            )

    @classmethod
    def contiguous(
        cls, region: RegionSpec, keys: Sequence[str], offsets: Sequence[int], lengths: Sequence[int]
    ) -> TransferBatch:
        """One piece per key."""
        return cls(
            region,
            tuple(keys),
            np.asarray(offsets, dtype=np.int64).reshape(-1, 1),
            np.asarray(lengths, dtype=np.int64).reshape(-1, 1),
        )

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def key_nbytes(self) -> np.ndarray:
        sums: np.ndarray = self.lengths.sum(axis=1)
        return sums

    def join(self, other: TransferBatch) -> TransferBatch:
        """This batch's keys, then ``other``'s (same region, as many pieces per key)."""
        if other.region != self.region or other.offsets.shape[1] != self.offsets.shape[1]:
            raise RegionError(
                "TransferBatch.join: batches of one region with as many pieces per key only "
                f"({self.region.region_id}: {self.offsets.shape[1]}, "
                f"{other.region.region_id}: {other.offsets.shape[1]})"
            )
        return TransferBatch(
            self.region,
            self.keys + other.keys,
            np.concatenate([self.offsets, other.offsets]),
            np.concatenate([self.lengths, other.lengths]),
        )

    def take(self, indices: Sequence[int]) -> TransferBatch:
        """The batch of keys ``indices`` (e.g. the DRAM misses a lower tier should load)."""
        idx = np.asarray(indices, dtype=np.int64)
        return TransferBatch(
            self.region, tuple(self.keys[i] for i in idx), self.offsets[idx], self.lengths[idx]
        )
