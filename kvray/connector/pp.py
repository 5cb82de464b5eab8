"""Blocks stored as several keys, each holding some of a rank's layers ("parts").

- Split by a pipeline-parallel prefill's layer partition: a decode instance without
  pipeline parallelism that stores (or loads) for a prefill with ``prefill_pp_size``
  stages keeps each block as one key per stage: the layers of stage ``p`` (the config
  parses ``prefill_pp_layer_partition``, e.g. ``"30,31"``, into layer counts once:
  ``ConnectorConfig.layer_partition``) under the key of PP rank ``p``, which is exactly
  what that prefill stage's worker stores and looks up.
- Layer-wise transfers (``use_layerwise``): each block of a rank is one key per group of
  its layers (``...@lg<g>of<G>@...``), so each group loads and saves on its own.

A part is ``(rank, layer group, first column, end column)``; a transfer's offsets and
lengths are ``(blocks, columns)`` with one column per layer (shared placement) or per
layer and plane (staged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvray.keys import KeySpace


class Part(NamedTuple):
    rank: int
    group: int
    lo: int
    hi: int


def stage_ranges(partition: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges of each stage: ``[30, 31] -> [(0, 30), (30, 61)]``."""
    bounds = np.concatenate([[0], np.cumsum(partition)]).astype(int).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def even_partition(num_layers: int, parts: int) -> list[int]:
    """``num_layers`` split into ``parts`` counts as even as possible, larger first."""
    base, rest = divmod(num_layers, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def stage_parts(
    space: KeySpace, tp_rank: int, partition: Sequence[int], planes: int = 1
) -> list[Part]:
    """One part per prefill PP stage, keyed by that stage's rank."""
    return [
        Part(pp * space.tp_size + tp_rank, 0, lo * planes, hi * planes)
        for pp, (lo, hi) in enumerate(stage_ranges(partition))
    ]


def group_parts(rank: int, num_layers: int, groups: int, planes: int = 1) -> list[Part]:
    """One part per layer group of this rank's ``num_layers`` layers."""
    return [
        Part(rank, g, lo * planes, hi * planes)
        for g, (lo, hi) in enumerate(stage_ranges(even_partition(num_layers, groups)))
    ]


def split_columns(
    space: KeySpace,
    hashes: Sequence[bytes],
    offsets: np.ndarray,
    lengths: np.ndarray,
    parts: Sequence[Part],
) -> list[tuple[tuple[str, ...], np.ndarray, np.ndarray]]:
    """One ``(keys, offsets, lengths)`` per part, each with its own columns."""
    if offsets.shape[1] != parts[-1].hi:
        raise ValueError(f"{offsets.shape[1]} columns (layers) but the parts cover {parts[-1].hi}")
    return [
        (
            tuple(space.rank_key_strs(hashes, p.rank, p.group)),
            offsets[:, p.lo : p.hi],
            lengths[:, p.lo : p.hi],
        )
        for p in parts
    ]
