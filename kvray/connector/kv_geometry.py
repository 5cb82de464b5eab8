"""Where each block of each layer lives in a vLLM KV cache, whatever the attention
backend's shape and strides, and which bytes kvray stores for it.

vLLM hands the connector one entry per attention layer: a tensor (vLLM 0.32's logical
``[B, H, N, C]`` view over any physical stride order; FlashAttention-style ``(2, B, N, H,
D)`` with K and V as separate planes; MLA's single latent ``(B, N, D)``) or, on Ascend, a
``(k_cache, v_cache)`` tuple. A *plane* is one tensor; its *block dimension* is the one of
size ``num_blocks`` (the engine's block count). What kvray stores for block ``b`` of a
layer is, plane by plane, the block's elements in the plane's logical order
(``plane.select(block_dim, b)``, made contiguous): independent of the physical strides, so
engines whose caches differ only in memory order store and load the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvray.errors import ConfigError

KVEntry = torch.Tensor | Sequence[torch.Tensor]
"""What vLLM gives per layer: one tensor, or a tuple of planes (Ascend's K and V)."""


@dataclass(frozen=True, slots=True)
class PlaneGeometry:
    block_dim: int
    block_shape: tuple[int, ...]
    """The plane's shape without its block dimension (one block's logical shape)."""
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.block_shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    planes: tuple[PlaneGeometry, ...]

    @property
    def nbytes(self) -> int:
        """Bytes kvray stores per block of this layer (all planes)."""
        return sum(p.nbytes for p in self.planes)


def planes_of(entry: KVEntry) -> list[torch.Tensor]:
    if isinstance(entry, torch.Tensor):
        return [entry]
    planes = list(entry)
    if not planes or not all(isinstance(p, torch.Tensor) for p in planes):
        raise ConfigError(
            f"KVRayConnector: a KV cache layer is a {type(entry).__name__} of "
            f"{[type(p).__name__ for p in planes]}; expected a tensor or a tuple of tensors"
        )
    return planes


def block_dim_of(plane: torch.Tensor, num_blocks: int, layer: str) -> int:
    """The dimension of size ``num_blocks``. When several have that size (a head or
    channel count equal to the block count), the block dimension is the one with the
    largest stride among them: a block holds everything below it, so it is outer to
    every dimension inside a block."""
    dims = [d for d, s in enumerate(plane.shape) if s == num_blocks]
    if not dims:
        raise ConfigError(
            f"KVRayConnector: KV cache layer {layer} has shape {tuple(plane.shape)} with no "
            f"dimension of the engine's {num_blocks} blocks; this attention backend's layout "
            "is not supported"
        )
    if len(dims) == 1:
        return dims[0]
    strides = [plane.stride(d) for d in dims]
    best = max(strides)
    if strides.count(best) > 1:
        raise ConfigError(
            f"KVRayConnector: KV cache layer {layer} has shape {tuple(plane.shape)} and "
            f"strides {plane.stride()}: cannot tell which dimension holds its {num_blocks} "
            "blocks; give the engine a different number of KV blocks (e.g. another "
            "gpu_memory_utilization or VLLM_CPU_KVCACHE_SPACE)"
        )
    return dims[strides.index(best)]


def layer_geometry(entry: KVEntry, num_blocks: int, layer: str = "?") -> LayerGeometry:
    planes = []
    for plane in planes_of(entry):
        d = block_dim_of(plane, num_blocks, layer)
        shape = tuple(s for i, s in enumerate(plane.shape) if i != d)
        planes.append(PlaneGeometry(d, shape, plane.dtype))
    return LayerGeometry(tuple(planes))


def check_uniform(geometries: dict[str, LayerGeometry]) -> LayerGeometry:
    """All layers must store blocks of one geometry (the key's layout tag is per
    instance); returns it."""
    distinct = set(geometries.values())
    if len(distinct) != 1:
        first, *rest = geometries.items()
        other = next((name, g) for name, g in rest if g != first[1])
        raise ConfigError(
            "KVRayConnector: KV cache layers differ in block geometry "
            f"({first[0]}: {first[1]}; {other[0]}: {other[1]}); kvray stores models whose "
            "attention layers share one KV layout"
        )
    return distinct.pop()


def geometry_tag(geometry: LayerGeometry) -> str:
    """A short lowercase description of the stored bytes' shape, e.g. ``p2x16x8x64``
    (one plane of 2x16x8x64) or ``p16x8x64.p16x8x64`` (Ascend's K and V planes)."""
    return ".".join("p" + "x".join(str(s) for s in p.block_shape) for p in geometry.planes)
