"""Blocks split by a pipeline-parallel prefill's layer partition.

A decode instance without pipeline parallelism that stores (or loads) for a prefill
instance with ``prefill_pp_size`` stages keeps each block as one key per stage: the layers
of stage ``p`` (``prefill_pp_layer_partition``, e.g. ``"30,31"``) under the key of PP rank
``p``, which is exactly what that prefill stage's worker stores and looks up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvray.keys import KeySpace


def stage_ranges(partition: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges of each stage: ``[30, 31] -> [(0, 30), (30, 61)]``."""
    bounds = np.concatenate([[0], np.cumsum(partition)]).astype(int).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def split_by_stage(
    space: KeySpace,
    tp_rank: int,
    hashes: Sequence[bytes],
    offsets: np.ndarray,
    lengths: np.ndarray,
    stages: Sequence[tuple[int, int]],
) -> list[tuple[tuple[str, ...], np.ndarray, np.ndarray]]:
    """One ``(keys, offsets, lengths)`` per stage; ``offsets``/``lengths`` are
    ``(blocks, layers)`` and each stage keeps its own layer columns."""
    if offsets.shape[1] != stages[-1][1]:
        raise ValueError(
            f"{offsets.shape[1]} layers but the prefill partition covers {stages[-1][1]}"
        )
    return [
        (
            tuple(space.rank_key_strs(hashes, pp * space.tp_size + tp_rank)),
            offsets[:, lo:hi],
            lengths[:, lo:hi],
        )
        for pp, (lo, hi) in enumerate(stages)
    ]
