"""One rank's KV blocks as its BackendClient sees them: the shared region they move
through, where each block's bytes lie in it, and the keys a block is stored under.

``shared``: the region is the KV cache itself (vLLM allocated it through the
connector's ``get_mem_pool_context``), and a block is its rows of every layer.
``staged``: the region is a staging area (:mod:`kvray.connector.staging`) whose slots a
transfer reserves; blocks are gathered into them and scattered back.

A block is one key of all its layers, or several (:mod:`kvray.connector.pp`): one per
prefill PP stage, or one per layer group (layer-wise transfers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvray.connector.kv_geometry import check_uniform, geometry_tag, layer_geometry
from kvray.connector.pp import Part, group_parts, split_columns, stage_parts
from kvray.connector.staging import Stager
from kvray.errors import ConfigError
from kvray.keys import geometry_digest
from kvray.transfer import TransferBatch

if TYPE_CHECKING:
    import torch

    from kvray.connector.instance import InstanceInfo
    from kvray.connector.kv_geometry import KVEntry
    from kvray.connector.metadata import BlockOp
    from kvray.shm import RegionSpec, SharedRegion

logger = logging.getLogger(__name__)


class KVRegion:
    """Where one rank's blocks are, in the region its client maps (shared, or staging)."""

    def __init__(
        self, info: InstanceInfo, rank: int, spec: RegionSpec, num_layers: int, row_bytes: int
    ) -> None:
        self.info = info
        self.rank = rank
        """This worker's rank in the instance (PP rank x TP size + TP rank): its keys."""
        self.spec = spec
        self.num_layers = num_layers
        self.row_bytes = row_bytes
        """Bytes of one block, all layers (what a key holds)."""
        self.stager: Stager | None = None
        """Staged: the staging slots; shared: None."""
        self._layer_offsets: np.ndarray | None = None
        self._block_stride = 0
        self._block_bytes = 0
        self.parts: list[Part] = []
        """Keys per block when a block is several keys (prefill PP stages or layer-wise
        groups), each with its columns; empty: one key of all columns."""
        self.group_of: dict[str, int] = {}
        """Layer-wise: layer name -> its group."""
        self.group_len: list[int] = []
        """Layer-wise: layers of each group."""

    # ---- registration --------------------------------------------------------------------

    @classmethod
    def shared(
        cls, info: InstanceInfo, rank: int, region: SharedRegion, kv_caches: Mapping[str, KVEntry]
    ) -> KVRegion:
        """The KV cache is ``region``: each layer a tensor of blocks in it."""
        layers = list(kv_caches.values())
        if not all(hasattr(t, "data_ptr") for t in layers):
            raise ConfigError(
                "KVRayConnector: kv_placement 'shared' needs one tensor per layer; this "
                "engine hands tuples of planes: set kv_placement to 'staged'"
            )
        tensors: list[torch.Tensor] = layers  # type: ignore[assignment]
        base, end = region.base_ptr, region.base_ptr + region.spec.size
        strides = {t.stride(0) * t.element_size() for t in tensors}
        if len(strides) != 1:
            raise ConfigError(
                f"KVRayConnector: layers have different block strides {sorted(strides)}"
            )
        stride = strides.pop()
        block_bytes = tensors[0][0].numel() * tensors[0].element_size()
        for t in tensors:
            nbytes = t.shape[0] * stride
            assert base <= t.data_ptr() and t.data_ptr() + nbytes <= end, (
                "KVRayConnector: a KV layer lies outside the shared region: vLLM's allocation "
                "changed; kvray's SharedKVAllocator must be updated"
            )
            assert t[0].is_contiguous(), "KVRayConnector: a KV block is not contiguous"
        self = cls(info, rank, region.spec, len(tensors), block_bytes * len(tensors))
        self._layer_offsets = np.array([t.data_ptr() - base for t in tensors], dtype=np.int64)
        self._block_stride = stride
        self._block_bytes = block_bytes
        return self

    @classmethod
    def staged(
        cls, info: InstanceInfo, rank: int, kv_caches: Mapping[str, KVEntry], prefix: str
    ) -> KVRegion:
        """The KV cache is anywhere: blocks go through a new staging region."""
        if info.num_blocks <= 0:
            raise ConfigError("KVRayConnector: vLLM's kv_cache_config has no num_blocks")
        stager = Stager(
            kv_caches,
            info.num_blocks,
            info.config.kv_staging_size,
            prefix,
            default_slots=2 * max(info.max_step_blocks, 1),
        )
        self = cls(info, rank, stager.region.spec, stager.num_layers, stager.block_bytes)
        self.stager = stager
        logger.info(
            "KVRayConnector staging: %d blocks (%d bytes) on %s, block geometry %s, pinned=%s",
            stager.capacity,
            stager.region.spec.size,
            stager.ops.device,
            stager.geometry,
            stager.pinned,
        )
        return self

    def geometry_tag(self, kv_caches: Mapping[str, KVEntry]) -> str:
        """The order of a block's bytes (the key's layout tag does not name it: it
        depends on the attention backend)."""
        if self.stager is not None:
            return geometry_tag(self.stager.geometry)
        geoms = {n: layer_geometry(e, self.info.num_blocks, n) for n, e in kv_caches.items()}
        return geometry_tag(check_uniform(geoms))

    def rank_geometries(self, kv_caches: Mapping[str, KVEntry]) -> dict[int, str]:
        """Instance rank -> the geometry part of the keys this worker stores for it
        (:func:`~kvray.keys.geometry_digest`): its own rank's, or, split by a prefill's
        PP stages, each stage's (that stage's layers, as the prefill worker of that stage
        names them). Call after :meth:`split_blocks`."""
        order = self.geometry_tag(kv_caches)
        names = list(kv_caches)
        if not self.info.split_stages:
            return {self.rank: geometry_digest(order, names)}
        planes = self.stager.planes_per_layer if self.stager else 1
        return {
            p.rank: geometry_digest(order, names[p.lo // planes : p.hi // planes])
            for p in self.parts
        }

    def use_geometries(self, geometries: Mapping[int, str]) -> None:
        """Key this worker's blocks with their geometries (from :meth:`rank_geometries`)."""
        space = self.info.space
        full = tuple(geometries.get(r, "") for r in range(space.world_size))
        self.info = replace(self.info, space=replace(space, geometries=full))

    def split_blocks(self, layer_names: list[str], tp_rank: int) -> None:
        """Blocks of several keys: by the prefill's PP stages, or by layer groups."""
        space = self.info.space
        planes = self.stager.planes_per_layer if self.stager else 1
        if self.info.split_stages:
            partition = self.info.config.layer_partition(self.num_layers)  # checks the sum
            self.parts = stage_parts(space, tp_rank, partition, planes)
            logger.info("KVRayConnector: blocks split by prefill PP partition %s", partition)
            return
        groups = space.layer_groups
        if groups == 1:
            return
        if groups > self.num_layers:
            raise ConfigError(
                f"layerwise_groups is {groups} but this worker holds {self.num_layers} KV "
                f"cache layers: set layerwise_groups to {self.num_layers} or less"
            )
        self.parts = group_parts(self.rank, self.num_layers, groups, planes)
        self.group_len = [(p.hi - p.lo) // planes for p in self.parts]
        self.group_of = {
            name: g
            for g, p in enumerate(self.parts)
            for name in layer_names[p.lo // planes : p.hi // planes]
        }
        logger.info(
            "KVRayConnector: layer-wise transfers, %d layer groups of %s layers",
            groups,
            self.group_len,
        )

    @property
    def layerwise(self) -> bool:
        return bool(self.group_of)

    # ---- transfers -----------------------------------------------------------------------

    def batches(self, ops: list[BlockOp], first_slot: int | None = None) -> list[TransferBatch]:
        """One batch, or one per part when a block is several keys (PP stages, layer
        groups). Shared: the blocks' places in the KV cache; staged: staging slots
        ``first_slot..``."""
        hashes = [h for op in ops for h in op.block_hashes]
        if first_slot is None:
            assert self._layer_offsets is not None, "KVRegion.batches: staged needs a slot"
            block_ids = np.array([b for op in ops for b in op.block_ids], dtype=np.int64)
            offsets = self._layer_offsets[None, :] + block_ids[:, None] * self._block_stride
            lengths = np.full(offsets.shape, self._block_bytes, dtype=np.int64)
        else:
            assert self.stager is not None
            offsets, lengths = self.stager.offsets(first_slot, len(hashes))
        if not self.parts:
            keys = tuple(self.info.space.rank_key_strs(hashes, self.rank))
            return [TransferBatch(self.spec, keys, offsets, lengths)]
        split = split_columns(self.info.space, hashes, offsets, lengths, self.parts)
        return [TransferBatch(self.spec, k, o, n) for k, o, n in split]

    def chunks(self, ops: list[BlockOp]) -> Iterator[list[BlockOp]]:
        """``ops`` in runs that fit staging (an op may be cut; shared: one run; none when
        there are no ops)."""
        if self.stager is None:
            if ops:
                yield ops
            return
        cap = self.stager.capacity
        chunk: list[BlockOp] = []
        n = 0
        for op in ops:
            i = 0
            while i < len(op.block_ids):
                take = min(cap - n, len(op.block_ids) - i)
                cut = slice(i, i + take)
                chunk.append(
                    replace(op, block_hashes=op.block_hashes[cut], block_ids=op.block_ids[cut])
                )
                n += take
                i += take
                if n == cap:
                    yield chunk
                    chunk, n = [], 0
        if chunk:
            yield chunk

    def fits(self, ops: list[BlockOp]) -> bool:
        """The blocks fit one staged transfer (always, shared). Layer-wise overlap needs
        that; a step larger than staging goes whole, in chunks, after the forward's
        start (correct, not overlapped)."""
        n = sum(len(op.block_ids) for op in ops)
        return self.stager is None or n <= self.stager.capacity

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
