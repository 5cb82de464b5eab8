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
  the external range, the window before the hit's end (the others are its null block);
- state (Mamba, Gated DeltaNet: one recurrent state per block-aligned boundary, in vLLM's
  "align" mode, which needs prefix caching on): the states vLLM offers the connector
  (``boundary_state_offloads``: the state after ``T`` tokens, in the block id it names),
  never a block read by its position in the block table; keyed by the hash of the block
  ending at ``T``. A hit of ``L`` tokens needs the state at exactly ``L``, which is loaded
  into the one block vLLM allocates for it.

Other kinds (chunked-local, sparse attention) are refused at startup, naming what runs
instead (docs/limits.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvray.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"
SLIDING = "sliding_window"
STATE = "state"
NULL_BLOCK = 0
"""vLLM's null block: what a block table holds where a group keeps no block (outside a
sliding window). Never loaded into, never saved from."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group of the engine."""

    index: int
    kind: str
    """:data:`FULL` (full attention, MLA), :data:`SLIDING` or :data:`STATE`."""
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int = 0
    """Tokens a sliding-window layer attends to (0: full attention)."""
    state: str = ""
    """A state group's state shapes and dtypes, e.g. ``(3, 512):bfloat16,(2, 128,
    128):float32``."""
    spec_kind: str = ""
    """vLLM's name of the group's kind (``KVCacheSpecKind``: ``full_attention``,
    ``mla_attention``, ``sliding_window``, ``mamba``), as KV events carry it."""

    @property
    def identity(self) -> str:
        """The group's kind and parameters, in its keys' geometry."""
        if self.kind == SLIDING:
            return f"{SLIDING}={self.sliding_window}"
        if self.kind == STATE:
            return f"{STATE}={self.state}"
        return self.kind

    @property
    def positional(self) -> bool:
        """Its blocks are the tokens' (saved from the block table as they are computed);
        a state group's are states at boundaries (saved as vLLM offers them)."""
        return self.kind != STATE

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
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        get_kv_cache_spec_kind,
    )

    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec: Any = group.kv_cache_spec
        names = tuple(group.layer_names)
        if isinstance(spec, MambaSpec):
            groups.append(_state_group(i, spec, names))
        elif isinstance(spec, SlidingWindowSpec):
            groups.append(KVGroup(i, SLIDING, names, spec.block_size, int(spec.sliding_window)))
        elif isinstance(spec, AttentionSpec) and type(spec).__name__ in _FULL_SPECS:
            window = getattr(spec, "sliding_window", None)
            if window is not None and len(kv_cache_config.kv_cache_groups) > 1:
                # (HMA on keeps sliding layers apart; one merged spec is HMA off)
                raise ConfigError(_unsupported(i, spec, names))
            groups.append(KVGroup(i, FULL, names, spec.block_size))
        else:
            raise ConfigError(_unsupported(i, spec, names))
        groups[-1] = replace(groups[-1], spec_kind=get_kv_cache_spec_kind(spec).value)
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise ConfigError(
            f"KVRayConnector: this model's KV cache groups have block sizes {sorted(sizes)}; "
            "kvray pools hybrid models whose groups share one block size (set --block-size "
            "so that vLLM gives every group the same)"
        )
    return tuple(groups)


def _state_group(i: int, spec: Any, names: tuple[str, ...]) -> KVGroup:
    if spec.mamba_cache_mode != "align":
        raise ConfigError(
            f"KVRayConnector: KV cache group {i} holds recurrent states (Mamba, linear "
            f"attention), which vLLM keeps per block boundary only in its 'align' mode; this "
            f"engine runs '{spec.mamba_cache_mode}': start vLLM with --enable-prefix-caching "
            "(vLLM then uses 'align')"
        )
    if getattr(spec, "num_speculative_blocks", 0):
        raise ConfigError(
            f"KVRayConnector: KV cache group {i} keeps speculative-decoding state blocks, "
            "which kvray does not pool: run this model without speculative decoding or "
            "without KVRayConnector"
        )
    state = ",".join(
        f"{tuple(shape)}:{str(dtype).removeprefix('torch.')}"
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )
    return KVGroup(i, STATE, names, spec.block_size, state=state)


_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
"""Attention specs whose group keeps every block of the context (one block of one token
range each): what kvray stores whole. Others (chunked-local, sparse, compressed) keep
blocks by rules kvray does not follow yet, and are refused."""


def _unsupported(i: int, spec: Any, names: tuple[str, ...]) -> str:
    kind = type(spec).__name__
    what = "a KV cache kind kvray does not pool yet"
    return (
        f"KVRayConnector: KV cache group {i} ({kind}, layers {', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''}) is {what}: run this model without "
        "KVRayConnector (vLLM's own prefix cache still serves it); docs/limits.md lists "
        "the model families kvray pools"
    )
