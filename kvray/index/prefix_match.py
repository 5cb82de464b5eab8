"""``Pool.prefix_match`` and ``kvray prefix-match``: how many leading blocks of a prefix
the pool holds, per tier and per node, answered from the manager's copy of the block
index (kvray/index/stream.py: every store, remove and found eviction its clients report).

A router weighs it against each instance's own prefix cache: an instance with a cold
device cache on a node whose pool tiers hold the prefix loads it instead of computing it.
The answer is advisory, as the index is: a block shown here that is gone by load time is a
failed load, recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvray.index.block_index import DRAM, BlockIndex, space_digests
from kvray.index.lookup import servable_hits
from kvray.keys import KeySpace


@dataclass(frozen=True)
class PrefixMatch:
    """Leading blocks of a prefix the pool holds for every rank's column of a key
    space."""

    blocks: int
    """Blocks asked about."""
    dram: int
    """Held in the pool's DRAM tier, which every node loads from."""
    ssd: dict[str, int]
    """Per node with an SSD tier (node id): held in that node's SSD tier alone."""
    nodes: dict[str, int]
    """Per node of the pool (node id): what an engine there loads, each column from DRAM
    or from that node's SSD tier."""
    addresses: dict[str, str]
    """The nodes' addresses (node id -> IP), as Ray knows them."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"{self.blocks} blocks asked; leading blocks held:",
            f"  DRAM (every node) {self.dram}",
        ]
        lines += [
            f"  node {node[:12]} {self.addresses.get(node, '?'):<15} {n:>5}"
            + (f"  (SSD alone {self.ssd[node]})" if node in self.ssd else "")
            for node, n in self.nodes.items()
        ]
        return "\n".join(lines)


def match(
    index: BlockIndex,
    space: KeySpace,
    hashes: Sequence[bytes],
    addresses: dict[str, str],
) -> PrefixMatch:
    """``hashes``' leading blocks in ``index`` for every column of ``space``, per tier and
    node (``addresses``: the pool's nodes; SSD places of other nodes are listed too)."""
    n = len(hashes)
    vals = index.tiers(space_digests(space, hashes).ravel()).reshape(space.columns, n)
    ssd: dict[str, int] = {}
    for node, slot in index.places():
        ssd[node] = ssd.get(node, 0) | index.place_bit(node, slot, register=False)

    def leading(mask: int) -> int:
        return servable_hits(((vals & np.uint32(mask)) != 0).ravel(), n, space)

    nodes = sorted(set(addresses) | set(ssd))
    return PrefixMatch(
        n,
        leading(DRAM),
        {node: leading(bits) for node, bits in sorted(ssd.items())},
        {node: leading(DRAM | ssd.get(node, 0)) for node in nodes},
        dict(addresses),
    )
