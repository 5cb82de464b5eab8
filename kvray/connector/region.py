"""One rank's KV blocks as its BackendClient sees them: the shared region they move
through, where each block's bytes lie in it, and the keys a block is stored under.

``shared``: the region is the KV cache itself (vLLM allocated it through the
connector's ``get_mem_pool_context``), and a block is its rows of every layer.
``staged``: the region is a staging area (:mod:`kvray.connector.staging`) whose slots a
transfer reserves; blocks are gathered into them and scattered back.

A block is one key of all its layers, or several (:mod:`kvray.connector.pp`): one per
prefill PP stage, or one per layer group (layer-wise transfers). A hybrid model's KV cache
groups (:mod:`kvray.connector.kv_groups`) each have their own blocks: an op moves one
group's blocks, through that group's layers (its columns: the layers are registered
group-major, so each group's are one run) under that group's keys.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvray.backends.base import KeyStatus
from kvray.connector.kv_geometry import check_uniform, geometry_tag, layer_geometry
from kvray.connector.pp import (
    Part,
    even_partition,
    group_parts,
    split_columns,
    stage_parts,
    stage_ranges,
)
from kvray.connector.staging import Stager
from kvray.errors import ConfigError
from kvray.keys import geometry_digest, group_geometry_digest
from kvray.transfer import TransferBatch

if TYPE_CHECKING:
    import torch

    from kvray.connector.instance import InstanceInfo
    from kvray.connector.kv_geometry import KVEntry
    from kvray.connector.metadata import BlockOp
    from kvray.shm import RegionSpec, SharedRegion

logger = logging.getLogger(__name__)


class PartWork(NamedTuple):
    """One part's share of a step's layer-wise saves."""

    batch: TransferBatch
    ops: list[BlockOp]
    block_ids: list[int]
    """Its blocks (of its KV cache group), in the order of its staging slots."""
    first: int | None
    """The staging slot of its first block (None: shared placement)."""


def all_ok(per_batch: list[list[KeyStatus]]) -> list[KeyStatus]:
    """A block loaded only if every part of it did (else: its first part's failure)."""
    return [
        KeyStatus.OK
        if all(s is KeyStatus.OK for s in col)
        else next(s for s in col if s is not KeyStatus.OK)
        for col in zip(*per_batch, strict=True)
    ]


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
        self._layer_bytes: np.ndarray | None = None
        """Shared: bytes of one block of each layer (a hybrid model's may differ)."""
        self.parts: list[Part] = []
        """Keys per block when a block is several keys (prefill PP stages or layer-wise
        groups), each with its columns; empty: one key of all columns."""
        self.group_of: dict[str, int] = {}
        """Layer-wise: layer name -> its group."""
        self.group_len: list[int] = []
        """Layer-wise: layers of each group."""
        self.kv_cols: list[tuple[int, int]] = []
        """Hybrid models (several KV cache groups): each group's layers ``[lo, hi)``,
        group-major; empty: one group of every layer."""
        self.part_kv: list[int] = []
        """A hybrid model's layer-wise parts: the KV cache group of each part."""

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
        layer_bytes = [t[0].numel() * t.element_size() for t in tensors]
        if len(set(layer_bytes)) > 1 and len(info.groups) < 2:
            raise ConfigError(
                f"KVRayConnector: layers have different block sizes {sorted(set(layer_bytes))} "
                "bytes; kvray stores models whose layers share one"
            )
        for t in tensors:
            nbytes = t.shape[0] * stride
            assert base <= t.data_ptr() and t.data_ptr() + nbytes <= end, (
                "KVRayConnector: a KV layer lies outside the shared region: vLLM's allocation "
                "changed; kvray's SharedKVAllocator must be updated"
            )
            assert t[0].is_contiguous(), "KVRayConnector: a KV block is not contiguous"
        self = cls(info, rank, region.spec, len(tensors), sum(layer_bytes))
        self._layer_offsets = np.array([t.data_ptr() - base for t in tensors], dtype=np.int64)
        self._block_stride = stride
        self._block_bytes = layer_bytes[0]
        self._layer_bytes = np.array(layer_bytes, dtype=np.int64)
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
            mixed=len(info.groups) > 1,
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
        return self._tag(kv_caches, 0, len(kv_caches))

    def _tag(self, kv_caches: Mapping[str, KVEntry], lo: int, hi: int) -> str:
        """:meth:`geometry_tag` of layers ``lo..hi`` (one KV cache group's), which must
        share one geometry."""
        if self.stager is not None:
            layers = self.stager.layer_geometries[lo:hi]
            return geometry_tag(check_uniform({str(lo + i): g for i, g in enumerate(layers)}))
        names = list(kv_caches)[lo:hi]
        geoms = {n: layer_geometry(kv_caches[n], self.info.num_blocks, n) for n in names}
        return geometry_tag(check_uniform(geoms))

    def rank_geometries(self, kv_caches: Mapping[str, KVEntry]) -> dict[int, str]:
        """Instance rank -> the geometry part of the keys this worker stores for it
        (:func:`~kvray.keys.geometry_digest`): its own rank's, or, split by a prefill's
        PP stages, each stage's (that stage's layers, as the prefill worker of that stage
        names them). Call after :meth:`split_blocks`."""
        names = list(kv_caches)
        if self.kv_cols:
            k, groups = len(self.kv_cols), self.info.groups
            return {
                self.rank * k + g: group_geometry_digest(
                    self._tag(kv_caches, lo, hi), group.identity, names[lo:hi]
                )
                for g, ((lo, hi), group) in enumerate(zip(self.kv_cols, groups, strict=True))
            }
        order = self.geometry_tag(kv_caches)
        if not self.info.split_stages:
            digest = geometry_digest(order, names)
            # (one copy across TP: the keys this rank loads are its stage's TP rank 0's,
            # whose bytes, and so geometry, are the same)
            return {self.rank: digest, self.info.space.key_rank(self.rank): digest}
        planes = self.stager.planes_per_layer if self.stager else 1
        return {
            p.rank: geometry_digest(order, names[p.lo // planes : p.hi // planes])
            for p in self.parts
        }

    def use_generation(self, generation: int) -> None:
        """Key the following transfers in ``generation`` (the scheduler's, after a
        reset of the pool's blocks: :meth:`KVRayScheduler.reset_cache`)."""
        self.info = replace(self.info, space=replace(self.info.space, generation=generation))

    def use_geometries(self, geometries: Mapping[int, str]) -> None:
        """Key this worker's blocks with their geometries (from :meth:`rank_geometries`)."""
        space = self.info.space
        full = tuple(geometries.get(r, "") for r in range(space.world_size * space.kv_groups))
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
        if groups == 1 or len(self.info.groups) > 1:  # (a hybrid model's: use_kv_groups)
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

    @property
    def replica(self) -> bool:
        """This rank's bytes are another TP rank's (MLA's latent, one copy across TP):
        it loads that rank's keys and saves nothing."""
        return self.info.space.key_rank(self.rank) != self.rank

    @property
    def kv_grouped(self) -> bool:
        """A hybrid model's blocks: each op moves one KV cache group's."""
        return bool(self.kv_cols)

    def use_kv_groups(self, layers_per_group: list[int], layer_names: Sequence[str] = ()) -> None:
        """The KV cache groups' layer counts, in the (group-major) order the layers were
        registered in (``layer_names``: that order, for layer-wise saves)."""
        if len(layers_per_group) < 2:
            return
        if sum(layers_per_group) != self.num_layers:
            raise ConfigError(
                f"KVRayConnector: the KV cache groups hold {sum(layers_per_group)} layers but "
                f"the engine registered {self.num_layers}: kvray's bug"
            )
        bounds = np.concatenate([[0], np.cumsum(layers_per_group)]).astype(int).tolist()
        self.kv_cols = list(zip(bounds[:-1], bounds[1:], strict=True))
        if self.info.config.use_layerwise:
            self._layer_parts_of_groups(layers_per_group, list(layer_names))

    def _layer_parts_of_groups(self, layers_per_group: list[int], names: list[str]) -> None:
        """Layer-wise saves of a hybrid model: each KV cache group's layers in
        ``layer_groups`` parts of their own (keys ``lg<j>of<L>`` of that group), sent as
        the forward completes them. Mamba and linear-attention layers call no per-layer
        hook, so a state group's parts go at the step's end, with what the hooks did not
        send."""
        groups = self.info.space.layer_groups
        fewest = min(layers_per_group)
        if groups > fewest:
            raise ConfigError(
                f"layerwise_groups is {groups} but a KV cache group of this worker holds "
                f"{fewest} layers: set layerwise_groups to {fewest} or less"
            )
        planes = self._planes()
        for g, (lo, hi) in enumerate(self.kv_cols):
            for j, (a, b) in enumerate(stage_ranges(even_partition(hi - lo, groups))):
                self.parts.append(Part(self.rank, j, (lo + a) * planes, (lo + b) * planes))
                self.part_kv.append(g)
        self.group_len = [(p.hi - p.lo) // planes for p in self.parts]
        self.group_of = {
            name: i
            for i, p in enumerate(self.parts)
            for name in names[p.lo // planes : p.hi // planes]
        }
        logger.info(
            "KVRayConnector: layer-wise saves of %d KV cache groups, %d layer groups each "
            "(the state groups' at the step's end: their layers call no per-layer hook; "
            "loads of a hybrid model are whole blocks, asynchronous)",
            len(self.kv_cols),
            groups,
        )

    @property
    def batches_per_run(self) -> int:
        """Batches :meth:`batches` makes per run of one KV cache group's ops (one per
        part of the group); the first of them counts the run's blocks. 1 without parts:
        then a batch may hold several runs, each block once."""
        if self.kv_cols:
            return self.info.space.layer_groups if self.parts else 1
        return max(1, len(self.parts))

    def layer_parts(self, ops: list[BlockOp], first_slot: int | None) -> dict[int, PartWork]:
        """Per part (layer group, of a KV cache group for a hybrid model) that ``ops``
        have blocks of: its batch, ops, block ids and first staging slot (layer-wise
        saves). A hybrid model's: by KV cache group, as :meth:`chunks` orders them (one
        run of staging slots per group)."""
        if not self.kv_cols:
            ids = [b for op in ops for b in op.block_ids]
            batches = self.batches(ops, first_slot)
            return {p: PartWork(b, ops, ids, first_slot) for p, b in enumerate(batches)}
        out: dict[int, PartWork] = {}
        pos = 0
        for g, _, _, run in self._runs(sorted(ops, key=lambda op: op.group)):
            ids = [b for op in run for b in op.block_ids]
            first = None if first_slot is None else first_slot + pos
            for p in (i for i, kv in enumerate(self.part_kv) if kv == g):
                batch = self._run_batch(g, run, first, self.parts[p])
                out[p] = PartWork(batch, run, ids, first)
            pos += len(ids)
        return out

    def row_bytes_of(self, group: int) -> int:
        """Bytes of one block of KV cache group ``group`` (what its key holds)."""
        if not self.kv_cols:
            return self.row_bytes
        lo, hi = self.kv_cols[group]
        if self.stager is not None:
            return sum(g.nbytes for g in self.stager.layer_geometries[lo:hi])
        assert self._layer_bytes is not None
        return int(self._layer_bytes[lo:hi].sum())

    def _planes(self) -> int:
        return self.stager.planes_per_layer if self.stager is not None else 1

    # ---- transfers -----------------------------------------------------------------------

    def batches(self, ops: list[BlockOp], first_slot: int | None = None) -> list[TransferBatch]:
        """One batch, or one per part when a block is several keys (PP stages, layer
        groups). Shared: the blocks' places in the KV cache; staged: staging slots
        ``first_slot..``."""
        if self.kv_cols:
            return self._group_batches(ops, first_slot)
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

    def _group_batches(self, ops: list[BlockOp], first_slot: int | None) -> list[TransferBatch]:
        """Per run of one KV cache group's ops (``ops`` sorted by group, as :meth:`chunks`
        gives them), its keys through that group's columns; their statuses, one after the
        other, are the blocks' in ``ops``' order. Layer-wise: a batch per layer group of
        each run. Else one batch for consecutive runs whose keys have as many pieces (vLLM
        gives a hybrid model's groups as many layers each): one call and one native batch
        for a step's blocks of every group, not one call per group (a Gemma 3 hit's four
        calls of 2-4 MiB each paid the actor's fixed costs and contended for its
        threads)."""
        out: list[TransferBatch] = []
        pos = 0
        for g, lo, hi, run in self._runs(ops):
            n = sum(len(op.block_ids) for op in run)
            first = None if first_slot is None else first_slot + pos
            pos += n
            if self.parts:  # layer-wise: one batch per layer group of the KV cache group
                parts = [self.parts[i] for i, kv in enumerate(self.part_kv) if kv == g]
                out += [self._run_batch(g, run, first, p) for p in parts]
                continue
            columns = Part(self.rank, 0, lo * self._planes(), hi * self._planes())
            batch = self._run_batch(g, run, first, columns)
            if out and out[-1].offsets.shape[1] == batch.offsets.shape[1]:
                out[-1] = out[-1].join(batch)
            else:
                out.append(batch)
        return out

    def _run_batch(
        self, g: int, run: list[BlockOp], first: int | None, part: Part
    ) -> TransferBatch:
        """One KV cache group's ``run`` of ops through ``part``'s columns (layers, times
        planes when staged), keyed by its layer group."""
        hashes = [h for op in run for h in op.block_hashes]
        if first is None:
            assert self._layer_offsets is not None and self._layer_bytes is not None
            lo, hi = part.lo, part.hi  # (shared: one column per layer)
            ids = np.array([b for op in run for b in op.block_ids], dtype=np.int64)
            offsets = self._layer_offsets[None, lo:hi] + ids[:, None] * self._block_stride
            lengths = np.broadcast_to(self._layer_bytes[lo:hi], offsets.shape).copy()
        else:
            assert self.stager is not None
            offsets, lengths = self.stager.offsets(first, len(hashes))
            offsets, lengths = offsets[:, part.lo : part.hi], lengths[:, part.lo : part.hi]
        keys = self.info.space.rank_key_strs(hashes, self.rank, part.group, kv_group=g)
        return TransferBatch(self.spec, tuple(keys), offsets, lengths)

    def _runs(self, ops: list[BlockOp]) -> Iterator[tuple[int, int, int, list[BlockOp]]]:
        """(group, its first layer, its end layer, the group's ops) per run of one KV
        cache group's ops."""
        i = 0
        while i < len(ops):
            g = ops[i].group
            j = i
            while j < len(ops) and ops[j].group == g:
                j += 1
            lo, hi = self.kv_cols[g]
            yield g, lo, hi, ops[i:j]
            i = j

    def gather(self, ops: list[BlockOp], first: int) -> None:
        """Staged: copy the ops' blocks into slots ``first..`` (a hybrid model's: each
        group's layers only)."""
        assert self.stager is not None
        if not self.kv_cols:
            self.stager.gather([b for op in ops for b in op.block_ids], first)
            return
        planes, pos = self._planes(), 0
        for _, lo, hi, run in self._runs(ops):
            ids = [b for op in run for b in op.block_ids]
            self.stager.gather(ids, first + pos, (lo * planes, hi * planes))
            pos += len(ids)

    def scatter(self, ops: list[BlockOp], first: int, rows: list[int]) -> None:
        """Staged: copy slots ``first + rows[i]`` into their blocks (``rows``: those that
        loaded, ascending). A hybrid model's: each group's layers only, so no group's
        block is written through another group's layers."""
        assert self.stager is not None
        block_ids = [b for op in ops for b in op.block_ids]
        if not self.kv_cols:
            self.stager.scatter([block_ids[i] for i in rows], first, rows)
            return
        planes, pos = self._planes(), 0
        for _, lo, hi, run in self._runs(ops):
            n = sum(len(op.block_ids) for op in run)
            mine = [r - pos for r in rows if pos <= r < pos + n]
            ids = [block_ids[pos + r] for r in mine]
            self.stager.scatter(ids, first + pos, mine, (lo * planes, hi * planes))
            pos += n

    def combine(self, per_batch: list[list[KeyStatus]]) -> list[KeyStatus]:
        """Per block of the ops :meth:`batches` was given, from its batches' statuses: a
        block loaded only if every key of it did."""
        if self.kv_cols:
            k = self.batches_per_run  # (a run's parts: a block loaded if all of them did)
            runs = [per_batch[i : i + k] for i in range(0, len(per_batch), k)]
            return [s for run in runs for s in (all_ok(run) if k > 1 else run[0])]
        return all_ok(per_batch)

    def chunks(self, ops: list[BlockOp]) -> Iterator[list[BlockOp]]:
        """``ops`` in runs that fit staging (an op may be cut; shared: one run; none when
        there are no ops). A hybrid model's: sorted by KV cache group."""
        if self.kv_cols:
            ops = sorted(ops, key=lambda op: op.group)
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
