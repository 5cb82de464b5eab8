"""The engine's KV cache groups as the pool keys them.

vLLM's hybrid allocator (HMA) keeps one KV cache group per kind of layer (full attention,
sliding window, ...), each with its own block table over one shared block pool; the
connector declares ``SupportsHMA`` so that vLLM keeps HMA on. Each group's block ``i``
covers the same tokens in every group (kvray takes groups of one block size), but lives in
another block id, and is stored under its own key: the group's kind, window and layers are
in its geometry digest (:func:`~kvray.keys.group_geometry_digest`).

What each group stores and loads:

- full attention (and MLA's latent): every block;
- sliding window: every block a step computes (vLLM frees blocks that left the window
  mid-request, and the pool keeps what the engine drops, so a later prompt sharing any
  block-aligned prefix finds its window); a hit loads only the blocks vLLM allocates for
  the external range, the window before the hit's end (the others are its null block).

Groups whose state is not a block of tokens (Mamba, linear attention) are refused at
startup, naming what runs instead (docs/limits.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvray.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"
SLIDING = "sliding_window"
NULL_BLOCK = 0
"""vLLM's null block: what a block table holds where a group keeps no block (outside a
sliding window). Never loaded into, never saved from."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group of the engine."""

    index: int
    kind: str
    """:data:`FULL` (full attention, MLA) or :data:`SLIDING`."""
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int = 0
    """Tokens a sliding-window layer attends to (0: full attention)."""

    @property
    def identity(self) -> str:
        """The group's kind and parameters, in its keys' geometry."""
        if self.kind == SLIDING:
            return f"{SLIDING}={self.sliding_window}"
        return self.kind

    @property
    def window_blocks(self) -> int:
        """Blocks a hit of this group loads at most (vLLM's: ``cdiv(window - 1, block) +
        1``); 0 for full attention (every block)."""
        if self.kind != SLIDING:
            return 0
        return -(-(self.sliding_window - 1) // self.block_size) + 1


def kv_groups(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """The engine's groups, in vLLM's order; a ConfigError for a group kvray cannot
    store, naming what to do."""
    from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec

    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec: Any = group.kv_cache_spec
        names = tuple(group.layer_names)
        if isinstance(spec, SlidingWindowSpec):
            groups.append(KVGroup(i, SLIDING, names, spec.block_size, int(spec.sliding_window)))
        elif isinstance(spec, AttentionSpec) and type(spec).__name__ in _FULL_SPECS:
            window = getattr(spec, "sliding_window", None)
            if window is not None and len(kv_cache_config.kv_cache_groups) > 1:
                # (HMA on keeps sliding layers apart; one merged spec is HMA off)
                raise ConfigError(_unsupported(i, spec, names))
            groups.append(KVGroup(i, FULL, names, spec.block_size))
        else:
            raise ConfigError(_unsupported(i, spec, names))
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise ConfigError(
            f"KVRayConnector: this model's KV cache groups have block sizes {sorted(sizes)}; "
            "kvray pools hybrid models whose groups share one block size (set --block-size "
            "so that vLLM gives every group the same)"
        )
    return tuple(groups)


_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
"""Attention specs whose group keeps every block of the context (one block of one token
range each): what kvray stores whole. Others (chunked-local, sparse, compressed) keep
blocks by rules kvray does not follow yet, and are refused."""


def _unsupported(i: int, spec: Any, names: tuple[str, ...]) -> str:
    kind = type(spec).__name__
    what = (
        "a recurrent state (Mamba, linear attention), which kvray does not pool yet"
        if "Mamba" in kind
        else "a KV cache kind kvray does not pool yet"
    )
    return (
        f"KVRayConnector: KV cache group {i} ({kind}, layers {', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''}) is {what}: run this model without "
        "KVRayConnector (vLLM's own prefix cache still serves it); docs/limits.md lists "
        "the model families kvray pools"
    )
