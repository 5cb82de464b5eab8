"""Worker side of KVRayConnector: register the engine's KV cache, one batched Ray call per
transfer for loads and for saves, completion and load-error reporting.

Two placements (``kv_placement``). ``shared``: the KV cache itself is a shared region
(vLLM allocates it through ``get_mem_pool_context``; CPU engines) and the rank's
BackendClient actor moves blocks straight from and into it. ``staged``: the KV cache
lives anywhere (GPU, NPU, CPU); blocks go through a staging region
(:mod:`kvray.connector.staging`), gathered after the forward and scattered back before
it, in transfers of at most the staging region's size.

When ``wait_for_save`` runs the step's KV is written (CPU forwards are synchronous; on a
device the gather waits for the forward's event).

Layer-wise (``use_layerwise``): each block is one key per group of layers. A step's sync
loads are sent at ``start_load_kv`` as one Ray call per group, and the forward waits for
group ``g`` only in ``wait_for_layer_load`` of its first layer (staged: then scatters that
group), so later groups arrive while earlier layers compute. A step's saves are sent
group by group from ``save_kv_layer`` once the group's last layer ran (staged: once its
gather, queued on the side stream after that layer, completed). A group the forward did
not wait for (an engine that skips the per-layer hooks) is reported as failed, never
used. Shared saves read the cache itself, so
a finished request's free is delayed until its saves completed (``request_finished``
returns True and ``get_finished`` reports it) and a preempted request's in-flight saves
are drained in ``handle_preemptions`` before its blocks can be reused.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvray.backends.base import KeyStatus
from kvray.connector.common import InstanceInfo, attach_pool
from kvray.connector.kv_geometry import check_uniform, geometry_tag, layer_geometry
from kvray.connector.metadata import BlockOp, KVRayMetadata
from kvray.connector.pp import Part, group_parts, split_columns, stage_parts
from kvray.connector.shm_kv import SharedKVAllocator
from kvray.connector.staging import Stager
from kvray.connector.stats import KVRayConnectorStats
from kvray.connector.timeline import StepClock, StepTimes
from kvray.errors import ConfigError
from kvray.naming import region_prefix
from kvray.transfer import TransferBatch

if TYPE_CHECKING:
    import torch

    from kvray.connector.kv_geometry import KVEntry
    from kvray.shm import SharedRegion

logger = logging.getLogger(__name__)


def check_geometry_claim(keys: str, mine: str, claimed: str) -> None:
    if claimed != mine:
        raise ConfigError(
            f"KVRayConnector: the pool holds blocks under {keys} whose bytes are shaped "
            f"{claimed}, but this engine's KV blocks are shaped {mine} (another attention "
            "backend or platform): its loads would be wrong bytes. Give this engine its own "
            "model_namespace in kv_connector_extra_config"
        )


@dataclass
class _LayerwiseLoad:
    """A step's sync loads in flight, one Ray call per layer group."""

    ops: list[BlockOp]
    block_ids: list[int]
    first: int | None
    refs: list[Any]
    statuses: list[list[KeyStatus]] = field(default_factory=list)
    """Of the groups done so far, in order."""
    on_time: bool = False
    """Every group was waited for by the forward (``wait_for_layer_load``)."""
    failed_call: bool = False
    """Some group's call failed or timed out (it may still write staging)."""
    scattered: Any = None
    """Event of the last scatter (device), to wait for before freeing staging."""

    @property
    def n(self) -> int:
        return len(self.block_ids)


@dataclass
class _LayerwiseSave:
    """A step's saves, sent group by group as the forward completes their layers."""

    ops: list[BlockOp]
    block_ids: list[int]
    first: int | None
    batches: list[TransferBatch]
    seen: list[set[str]]
    """Layers of each group that ran."""
    gathered: dict[int, Any] = field(default_factory=dict)
    """Group -> gather event (staged on a device) of groups gathered, not yet sent."""
    refs: dict[int, Any] = field(default_factory=dict)
    """Group -> its put's ref."""

    @property
    def n(self) -> int:
        return len(self.block_ids)


def _rank() -> tuple[int, int, int]:
    """(TP rank, PP rank, local rank on this node) of this worker."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_world_group,
    )

    return (
        get_tensor_model_parallel_rank(),
        get_pp_group().rank_in_group,
        get_world_group().local_rank,
    )


class KVRayWorker:
    """One per vLLM worker (rank)."""

    def __init__(self, info: InstanceInfo) -> None:
        self.info = info
        handles = attach_pool(info.config, info.local_workers)
        self._call_timeout_s = handles.config.call_timeout_s
        self._pool_name = handles.config.name
        self._handles = handles
        self.rank = -1
        self._actor: Any = None
        self._allocator: SharedKVAllocator | None = None
        self._layer_offsets: np.ndarray | None = None
        self._block_stride = 0
        self._block_bytes = 0
        self._row_bytes = 0
        """Bytes of one block, all layers (what a key holds)."""
        self._num_layers = 0
        self._stager: Stager | None = None
        self._meta: KVRayMetadata | None = None
        self._save_refs: dict[Any, tuple[list[str], int, bool, int]] = {}
        """In-flight save: (request ids, blocks, counts the blocks, bytes per block)."""
        self._saves_of: dict[str, set[Any]] = defaultdict(set)
        self._finishing: set[str] = set()
        self._async_loads: dict[tuple[Any, ...], tuple[list[BlockOp], int, int | None]] = {}
        """In-flight async load: (ops, blocks, first staging slot or None when shared)."""
        self._holds: dict[tuple[Any, ...], tuple[int, int]] = {}
        """Staging slots held until all these calls ended (saves reading them; loads that
        failed while their calls may still write them)."""
        self._loaded: set[str] = set()
        """Requests whose async loads (some of them) are done, to report once all are."""
        self._tp_rank = 0
        self._parts: list[Part] = []
        """Keys per block when a block is several keys (prefill PP stages or layer-wise
        groups), each with its columns; empty: one key of all columns."""
        self._group_of: dict[str, int] = {}
        """Layer-wise: layer name -> its group."""
        self._group_len: list[int] = []
        self._lw_load: _LayerwiseLoad | None = None
        self._lw_save: _LayerwiseSave | None = None
        self._warned_late = False
        self._load_errors: set[int] = set()
        self.stats = KVRayConnectorStats()
        self._clock = StepClock()

    # ---- setup ---------------------------------------------------------------------------

    def _wants_shared(self) -> bool:
        placement = self.info.config.kv_placement
        if placement == "auto":
            from vllm.platforms import current_platform

            return bool(current_platform.is_cpu())
        return placement == "shared"

    def get_mem_pool_context(self) -> SharedKVAllocator | None:
        """``shared``: serve the KV cache allocation from shared memory; ``staged`` (and
        ``auto`` off CPU): None, so vLLM allocates as always (its own pools included)."""
        if not self._wants_shared():
            return None
        self._allocator = SharedKVAllocator(f"{region_prefix(self._pool_name)}-kv")
        return self._allocator

    def register_kv_caches(self, kv_caches: Mapping[str, KVEntry]) -> None:
        tp_rank, pp_rank, local_rank = _rank()
        self._tp_rank = tp_rank
        self.rank = pp_rank * self.info.space.tp_size + tp_rank
        world = self._handles.config.world_size
        if local_rank >= world:
            raise ConfigError(
                f"this worker is local rank {local_rank} on its node, but kvray pool "
                f"{self._pool_name!r} has {world} client(s) per node (world_size): restart "
                f"the pool with `kvray up --world-size {local_rank + 1}` or more (the most "
                "engine workers any node runs)"
            )
        # This node's client of this device/rank: the KV bytes move through shared memory.
        self._actor = self._handles.client(local_rank)
        ray.get(self._actor.probe.remote(), timeout=60)  # connect now, not on the first load
        if not kv_caches:
            raise ConfigError("KVRayConnector: the engine registered no KV cache layers")
        region = self._allocator.region if self._allocator else None
        if region is not None:
            self._register_shared(region, kv_caches)
            placement = "shared"
        elif self.info.config.kv_placement == "shared":
            raise ConfigError(
                "kv_placement is 'shared' but the KV cache is not in shared memory (vLLM did "
                "not allocate it through the connector's get_mem_pool_context: a GPU or NPU "
                "engine): set kv_placement to 'staged' or 'auto'"
            )
        else:
            self._register_staged(kv_caches)
            placement = "staged"
        self._claim_geometry(kv_caches)
        self._split_blocks(list(kv_caches))
        # The client maps (every page of) the region now, not in the first transfer.
        ray.get(self._actor.map_region.remote(self._region_spec), timeout=600)
        logger.info(
            "KVRayConnector worker rank %d: %d layers, %d bytes per block, %s placement, region %s",
            self.rank,
            self._num_layers,
            self._row_bytes,
            placement,
            self._region_spec.region_id,
        )

    def _split_blocks(self, layer_names: list[str]) -> None:
        """Blocks of several keys: by the prefill's PP stages, or by layer groups."""
        space = self.info.space
        planes = self._stager.planes_per_layer if self._stager else 1
        if self.info.split_stages:
            partition = self.info.config.layer_partition(self._num_layers)  # checks the sum
            self._parts = stage_parts(space, self._tp_rank, partition, planes)
            logger.info("KVRayConnector: blocks split by prefill PP partition %s", partition)
            return
        groups = space.layer_groups
        if groups == 1:
            return
        if groups > self._num_layers:
            raise ConfigError(
                f"layerwise_groups is {groups} but this worker holds {self._num_layers} KV "
                f"cache layers: set layerwise_groups to {self._num_layers} or less"
            )
        self._parts = group_parts(self.rank, self._num_layers, groups, planes)
        self._group_len = [(p.hi - p.lo) // planes for p in self._parts]
        self._group_of = {
            name: g
            for g, p in enumerate(self._parts)
            for name in layer_names[p.lo // planes : p.hi // planes]
        }
        logger.info(
            "KVRayConnector: layer-wise transfers, %d layer groups of %s layers",
            groups,
            self._group_len,
        )

    @property
    def _layerwise(self) -> bool:
        return bool(self._group_of)

    def _claim_geometry(self, kv_caches: Mapping[str, KVEntry]) -> None:
        """The key's layout tag names dtype, block size and head split, not the order of
        a block's bytes, which depends on the attention backend. The pool remembers the
        geometry of each ``namespace@layout``; an engine whose blocks have another one
        (another backend or platform) is refused before it writes or reads a block."""
        if self._stager is not None:
            geometry = self._stager.geometry
        else:
            geoms = {n: layer_geometry(e, self.info.num_blocks, n) for n, e in kv_caches.items()}
            geometry = check_uniform(geoms)
        mine = geometry_tag(geometry)
        space = self.info.space
        keys = f"{space.namespace}@{space.layout}"
        claimed = ray.get(self._handles.manager.claim_geometry.remote(keys, mine), timeout=60)
        check_geometry_claim(keys, mine, claimed)

    def _register_shared(self, region: SharedRegion, kv_caches: Mapping[str, KVEntry]) -> None:
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
        self._block_stride = strides.pop()
        self._block_bytes = tensors[0][0].numel() * tensors[0].element_size()
        for t in tensors:
            nbytes = t.shape[0] * self._block_stride
            assert base <= t.data_ptr() and t.data_ptr() + nbytes <= end, (
                "KVRayConnector: a KV layer lies outside the shared region: vLLM's allocation "
                "changed; kvray's SharedKVAllocator must be updated"
            )
            assert t[0].is_contiguous(), "KVRayConnector: a KV block is not contiguous"
        self._layer_offsets = np.array([t.data_ptr() - base for t in tensors], dtype=np.int64)
        self._num_layers = len(tensors)
        self._row_bytes = self._block_bytes * self._num_layers
        self._region_spec = region.spec

    def _register_staged(self, kv_caches: Mapping[str, KVEntry]) -> None:
        info = self.info
        if info.num_blocks <= 0:
            raise ConfigError("KVRayConnector: vLLM's kv_cache_config has no num_blocks")
        stager = Stager(
            kv_caches,
            info.num_blocks,
            info.config.kv_staging_size,
            f"{region_prefix(self._pool_name)}-stage",
            default_slots=2 * max(info.max_step_blocks, 1),
        )
        self._stager = stager
        self._num_layers = stager.num_layers
        self._row_bytes = stager.block_bytes
        self._region_spec = stager.region.spec
        logger.info(
            "KVRayConnector staging: %d blocks (%d bytes) on %s, block geometry %s, pinned=%s",
            stager.capacity,
            stager.region.spec.size,
            stager.ops.device,
            stager.geometry,
            stager.pinned,
        )

    def _batches(self, ops: list[BlockOp], first_slot: int | None = None) -> list[TransferBatch]:
        """One batch, or one per part when a block is several keys (PP stages, layer
        groups). Shared: the blocks' places in the KV cache; staged: staging slots
        ``first_slot..``."""
        hashes = [h for op in ops for h in op.block_hashes]
        if first_slot is None:
            assert self._layer_offsets is not None, "KVRayWorker used before register_kv_caches"
            block_ids = np.array([b for op in ops for b in op.block_ids], dtype=np.int64)
            offsets = self._layer_offsets[None, :] + block_ids[:, None] * self._block_stride
            lengths = np.full(offsets.shape, self._block_bytes, dtype=np.int64)
        else:
            assert self._stager is not None
            offsets, lengths = self._stager.offsets(first_slot, len(hashes))
        if not self._parts:
            keys = tuple(self.info.space.rank_key_strs(hashes, self.rank))
            return [TransferBatch(self._region_spec, keys, offsets, lengths)]
        split = split_columns(self.info.space, hashes, offsets, lengths, self._parts)
        return [TransferBatch(self._region_spec, k, o, n) for k, o, n in split]

    def _chunks(self, ops: list[BlockOp]) -> Iterator[list[BlockOp]]:
        """``ops`` in runs that fit staging (an op may be cut; shared: one run; none when
        there are no ops)."""
        if self._stager is None:
            if ops:
                yield ops
            return
        cap = self._stager.capacity
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

    def _reserve(self, n: int) -> int | None:
        """``n`` staging slots; waits for in-flight transfers to release some when staging
        is full (bounded memory). None when nothing was released within
        ``call_timeout_s`` (the pool is stuck): the caller fails that transfer."""
        assert self._stager is not None
        deadline = time.monotonic() + self._call_timeout_s
        while True:
            first = self._stager.reserve(n)
            if first is not None:
                return first
            refs = [r for g in [*self._holds, *self._async_loads] for r in g]
            assert refs, "staging full with nothing in flight"
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning(
                    "rank %d: no staging slot freed in %.0f s (pool calls in flight do not "
                    "finish); a transfer of %d blocks fails",
                    self.rank,
                    self._call_timeout_s,
                    n,
                )
                return None
            ray.wait(refs, num_returns=1, timeout=left)
            self._reap_saves(block=False)
            self._poll_async_loads()

    @staticmethod
    def _all_ok(per_batch: list[list[KeyStatus]]) -> list[KeyStatus]:
        """A block loaded only if every stage of it did."""
        return [
            KeyStatus.OK
            if all(s is KeyStatus.OK for s in col)
            else next(s for s in col if s is not KeyStatus.OK)
            for col in zip(*per_batch, strict=True)
        ]

    # ---- per step ------------------------------------------------------------------------

    def bind(self, meta: KVRayMetadata) -> None:
        self._meta = meta
        self._finishing.update(meta.delayed_frees)
        self._clock.bind(meta.step)

    def step_times(self) -> StepTimes | None:
        """This step's connector times, for the scheduler side (once per step)."""
        times = self._clock.times()
        if times is not None and times.load_wait_ms:
            self.stats.add("load_wait_us", int(times.load_wait_ms * 1e3))
        return times

    def handle_preemptions(self, meta: KVRayMetadata) -> None:
        refs = [r for rid in meta.preempted for r in self._saves_of.get(rid, ())]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self._call_timeout_s)
            self._reap_saves(block=False)

    def start_load_kv(self) -> None:
        t0 = time.perf_counter()
        try:
            self._start_load_kv()
        finally:
            # Sync loads hold the forward back; async ones only cost their submission.
            waited = bool(self._meta and self._meta.loads)
            self._clock.loaded(time.perf_counter() - t0, waited=waited)

    def _start_load_kv(self) -> None:
        self._finish_layerwise_load()  # a step whose forward never reached wait_for_save
        meta = self._meta
        if meta is None:
            return
        sync_loads = meta.loads
        if self._layerwise and sync_loads and self._fits(sync_loads):
            self._start_layerwise_load(sync_loads)
            sync_loads = []
        for chunk in self._chunks(sync_loads):
            n = sum(len(op.block_ids) for op in chunk)
            first = None
            if self._stager is not None:
                first = self._reserve(n)
                if first is None:
                    self._account_loads(chunk, [KeyStatus.ERROR] * n)
                    continue
            refs: list[Any] = []
            try:
                refs = [self._actor.get.remote(b) for b in self._batches(chunk, first)]
                statuses = self._all_ok(ray.get(refs, timeout=self._call_timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("rank %d: load of %d blocks failed: %s", self.rank, n, exc)
                statuses = [KeyStatus.ERROR] * n
                if first is not None:
                    # A call still running may write these slots later: they stay held
                    # until it ended, so no other transfer can be handed its bytes.
                    self._holds[tuple(refs)] = (first, n)
                    first = None
            if first is not None:
                self._scatter(chunk, first, statuses)
            self._account_loads(chunk, statuses)
        for chunk in self._chunks(meta.async_loads):
            n = sum(len(op.block_ids) for op in chunk)
            first = None
            if self._stager is not None:
                first = self._reserve(n)
                if first is None:
                    self._account_loads(chunk, [KeyStatus.ERROR] * n)
                    self._loaded.update(op.req_id for op in chunk)
                    continue
            group = tuple(self._actor.get.remote(b) for b in self._batches(chunk, first))
            self._async_loads[group] = (chunk, n, first)

    def _fits(self, ops: list[BlockOp]) -> bool:
        """The blocks fit one staged transfer (always, shared). Layer-wise overlap needs
        that; a step larger than staging goes whole, in chunks, after the forward's
        start (correct, not overlapped)."""
        n = sum(len(op.block_ids) for op in ops)
        return self._stager is None or n <= self._stager.capacity

    # ---- layer-wise ----------------------------------------------------------------------

    def _start_layerwise_load(self, ops: list[BlockOp]) -> None:
        block_ids = [b for op in ops for b in op.block_ids]
        n = len(block_ids)
        first = None
        if self._stager is not None:
            first = self._reserve(n)
            if first is None:
                self._account_loads(ops, [KeyStatus.ERROR] * n)
                return
        refs = [self._actor.get.remote(b) for b in self._batches(ops, first)]
        load = _LayerwiseLoad(ops, block_ids, first, refs)
        if self._stager is not None:
            # Scatters wait only for what was queued before this step, not for the layers
            # before them: the blocks they fill are not read earlier in the forward.
            load.scattered = self._stager.ops.compute_mark()
        self._lw_load = load

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._lw_load
        g = self._group_of.get(layer_name)
        if load is None or g is None or len(load.statuses) > g:
            return
        t0 = time.perf_counter()
        while len(load.statuses) <= g:
            self._finish_load_group(load)
        self._clock.loaded(time.perf_counter() - t0, waited=True)
        if len(load.statuses) == len(self._parts):
            load.on_time = True

    def _finish_load_group(self, load: _LayerwiseLoad, *, scatter: bool = True) -> None:
        """Wait for the next group's call; staged: scatter the blocks it loaded into
        that group's layers (queued on the side stream, the compute stream waits)."""
        g = len(load.statuses)
        try:
            statuses = ray.get(load.refs[g], timeout=self._call_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.warning(
                "rank %d: load of layer group %d (%d blocks) failed: %s", self.rank, g, load.n, exc
            )
            statuses = [KeyStatus.ERROR] * load.n
            load.failed_call = True
        load.statuses.append(statuses)
        if scatter and load.first is not None and not load.failed_call:
            assert self._stager is not None
            rows = [i for i, st in enumerate(statuses) if st is KeyStatus.OK]
            part = self._parts[g]
            if rows:
                done = self._stager.scatter(
                    [load.block_ids[i] for i in rows],
                    load.first,
                    rows,
                    (part.lo, part.hi),
                    after=load.scattered,
                    wait=False,
                )
                load.scattered = done if done is not None else load.scattered

    def _finish_layerwise_load(self) -> None:
        """After the forward: account the step's layer-wise loads and free their staging.
        Groups the forward did not wait for are waited for here and reported failed."""
        load = self._lw_load
        if load is None:
            return
        self._lw_load = None
        while len(load.statuses) < len(self._parts):
            self._finish_load_group(load, scatter=False)
        statuses = self._all_ok(load.statuses)
        if not load.on_time:
            # The forward ran before these groups arrived: their blocks were not in the
            # cache when it read them. Reported failed (vLLM recomputes), never used.
            statuses = [KeyStatus.ERROR] * load.n
            if not self._warned_late:
                self._warned_late = True
                logger.warning(
                    "rank %d: the engine ran a forward without calling wait_for_layer_load "
                    "for every layer (full CUDA graphs or a model without vLLM's attention "
                    "hooks): the step's pool hits were recomputed; set use_layerwise to "
                    "false for this engine",
                    self.rank,
                )
        if load.first is not None:
            assert self._stager is not None
            if load.scattered is not None:
                load.scattered.synchronize()  # queued copies read the slots
            if load.failed_call:
                # A call that failed may still write these slots: held until it ended.
                self._holds[tuple(load.refs)] = (load.first, load.n)
            else:
                self._stager.release(load.first, load.n)
        self._account_loads(load.ops, statuses)

    def save_kv_layer(self, layer_name: str) -> None:
        g = self._group_of.get(layer_name)
        meta = self._meta
        if g is None or meta is None or not meta.saves:
            return
        save = self._lw_save
        if save is None:
            if not self._fits(meta.saves):
                return  # wait_for_save sends the step whole, in chunks
            save = self._start_layerwise_save(meta.saves)
            if save is None:
                return
        save.seen[g].add(layer_name)
        if len(save.seen[g]) == self._group_len[g] and g not in save.refs:
            self._gather_group(save, g)
        self._send_gathered(save, block=False)

    def _start_layerwise_save(self, ops: list[BlockOp]) -> _LayerwiseSave | None:
        block_ids = [b for op in ops for b in op.block_ids]
        n = len(block_ids)
        first = None
        if self._stager is not None:
            first = self._reserve(n)
            if first is None:
                self.stats.add("save_failed_blocks", n)
                # The step's saves failed: neither later layers nor wait_for_save retry.
                self._meta = replace(self._meta, saves=[]) if self._meta else None
                return None
        batches = self._batches(ops, first)
        groups = [set[str]() for _ in self._parts]
        self._lw_save = _LayerwiseSave(ops, block_ids, first, batches, groups)
        return self._lw_save

    def _gather_group(self, save: _LayerwiseSave, g: int) -> None:
        """Queue the copy of group ``g``'s layers into staging (after the compute queued
        so far: its layers); shared placement: nothing to copy."""
        if save.first is None:
            save.gathered[g] = None
            return
        assert self._stager is not None
        part = self._parts[g]
        save.gathered[g] = self._stager.gather(
            save.block_ids, save.first, (part.lo, part.hi), wait=False
        )

    def _send_gathered(self, save: _LayerwiseSave, *, block: bool) -> None:
        """Send the put of every gathered group whose copy completed (``block``: all)."""
        for g, ev in sorted(save.gathered.items()):
            if ev is not None and not block and not ev.query():
                continue
            if ev is not None:
                ev.synchronize()
            del save.gathered[g]
            save.refs[g] = self._send_save(save.ops, save.batches[g], counts_blocks=g == 0)

    def _send_save(self, ops: list[BlockOp], batch: TransferBatch, *, counts_blocks: bool) -> Any:
        rids = [op.req_id for op in ops]
        ref = self._actor.put.remote(batch)
        # Blocks are counted once (part 0); bytes by each part's columns.
        row = int(batch.lengths[0].sum()) if len(batch) else 0
        self._save_refs[ref] = (rids, len(batch), counts_blocks, row)
        for rid in rids:
            self._saves_of[rid].add(ref)
        return ref

    def _end_layerwise_save(self) -> None:
        """End of the forward: gather and send what the per-layer hooks did not, then
        hold staging until every put ended."""
        save = self._lw_save
        if save is None:
            return
        self._lw_save = None
        for g in range(len(self._parts)):
            if g not in save.refs and g not in save.gathered:
                self._gather_group(save, g)
        self._send_gathered(save, block=True)
        if save.first is not None:
            self._holds[tuple(save.refs.values())] = (save.first, save.n)

    # ---- whole steps ---------------------------------------------------------------------

    def _scatter(self, ops: list[BlockOp], first: int, statuses: list[KeyStatus]) -> None:
        """Staged: the blocks that loaded, from their slots into the KV cache; frees the
        slots. A block that failed is left alone (vLLM recomputes it)."""
        assert self._stager is not None
        block_ids = [b for op in ops for b in op.block_ids]
        rows = [i for i, s in enumerate(statuses) if s is KeyStatus.OK]
        try:
            self._stager.scatter([block_ids[i] for i in rows], first, rows)
        finally:
            self._stager.release(first, len(block_ids))

    def _account_loads(self, ops: list[BlockOp], statuses: list[KeyStatus]) -> None:
        block_ids = [b for op in ops for b in op.block_ids]
        failed = {b for b, s in zip(block_ids, statuses, strict=True) if s is not KeyStatus.OK}
        self._load_errors |= failed
        self.stats.add("loaded_blocks", len(block_ids) - len(failed))
        self.stats.add("loaded_bytes", (len(block_ids) - len(failed)) * self._row_bytes)
        self.stats.add("load_failed_blocks", len(failed))
        gone = {b for b, s in zip(block_ids, statuses, strict=True) if s is KeyStatus.NOT_FOUND}
        bad = {b for b, s in zip(block_ids, statuses, strict=True) if s is KeyStatus.CORRUPT}
        self.stats.add("miss_gone_at_load", len(gone))
        self.stats.add("miss_corrupt", len(bad))
        self.stats.add("miss_load_failed", len(failed - gone - bad))
        if failed:
            logger.warning(
                "rank %d: %d of %d pool blocks failed to load; reported to vLLM",
                self.rank,
                len(failed),
                len(block_ids),
            )

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        try:
            self._wait_for_save()
        finally:
            self._clock.saving(t0, time.perf_counter() - t0)

    def _wait_for_save(self) -> None:
        self._finish_layerwise_load()
        if self._lw_save is not None:
            self._end_layerwise_save()
            return
        meta = self._meta
        if meta is None or not meta.saves:
            return
        for chunk in self._chunks(meta.saves):
            first = None
            if self._stager is not None:
                block_ids = [b for op in chunk for b in op.block_ids]
                first = self._reserve(len(block_ids))
                if first is None:
                    self.stats.add("save_failed_blocks", len(block_ids))
                    continue
                try:
                    self._stager.gather(block_ids, first)
                except BaseException:
                    self._stager.release(first, len(block_ids))
                    raise
            refs = [
                self._send_save(chunk, batch, counts_blocks=part == 0)
                for part, batch in enumerate(self._batches(chunk, first))
            ]
            if first is not None:
                self._holds[tuple(refs)] = (first, len(block_ids))

    def _reap_saves(self, *, block: bool) -> None:
        refs = list(self._save_refs)
        if not refs:
            self._release_holds()
            return
        ready, _ = ray.wait(
            refs, num_returns=len(refs), timeout=self._call_timeout_s if block else 0
        )
        for ref in ready:
            rids, n, first, row_bytes = self._save_refs.pop(ref)
            try:
                statuses = ray.get(ref)
                ok = sum(s is KeyStatus.OK for s in statuses)
            except ray.exceptions.RayError as exc:
                logger.warning("rank %d: save of %d blocks failed: %s", self.rank, n, exc)
                ok = 0
            if first:
                self.stats.add("saved_blocks", ok)
                self.stats.add("save_failed_blocks", n - ok)
            self.stats.add("saved_bytes", ok * row_bytes)
            for rid in rids:
                refs_of = self._saves_of.get(rid)
                if refs_of is not None:
                    refs_of.discard(ref)
                    if not refs_of:
                        del self._saves_of[rid]
        self._release_holds()

    def _release_holds(self) -> None:
        """Free the staging slots of every hold whose calls have all ended."""
        if self._stager is None or not self._holds:
            return
        refs = [r for group in self._holds for r in group]
        ended = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for group in [g for g in self._holds if all(r in ended for r in g)]:
            self._stager.release(*self._holds.pop(group))

    def _poll_async_loads(self) -> None:
        """Account (and, staged, scatter) every async load whose calls are all done."""
        if not self._async_loads:
            return
        refs = [r for group in self._async_loads for r in group]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for group in [g for g in self._async_loads if all(r in ready for r in g)]:
            ops, n, first = self._async_loads.pop(group)
            try:
                statuses = self._all_ok(ray.get(list(group)))
            except ray.exceptions.RayError as exc:
                logger.warning("rank %d: async load of %d blocks failed: %s", self.rank, n, exc)
                statuses = [KeyStatus.ERROR] * n
            if first is not None:
                self._scatter(ops, first, statuses)
            self._account_loads(ops, statuses)  # errors recorded before reporting done
            self._loaded.update(op.req_id for op in ops)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finish_layerwise_load()
        self._end_layerwise_save()
        self._reap_saves(block=False)
        sending = {rid for rid in self._finishing if rid not in self._saves_of}
        self._finishing -= sending
        self._poll_async_loads()
        # A request whose blocks were cut into several staged transfers is done when the
        # last of them is.
        pending = {op.req_id for ops, _, _ in self._async_loads.values() for op in ops}
        recving = self._loaded - pending
        self._loaded -= recving
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if not ray.is_initialized():
            # Interpreter exit after Ray's own atexit shutdown (vLLM's finalizer runs
            # later): the refs are gone with Ray's session, and a Ray call would start a
            # new one. Only this process's memory is left to release.
            self._close_memory()
            return
        self._finish_layerwise_load()
        self._end_layerwise_save()
        self._reap_saves(block=True)
        if self._stager is not None and self._async_loads:  # the actor may still write
            refs = [r for group in self._async_loads for r in group]
            ray.wait(refs, num_returns=len(refs), timeout=self._call_timeout_s)
        self._close_memory()

    def _close_memory(self) -> None:
        if self._allocator is not None:
            self._allocator.close()
        if self._stager is not None:
            self._stager.close()
