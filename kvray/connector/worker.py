"""Worker side of KVRayConnector: register the engine's KV cache, one batched Ray call per
transfer for loads and for saves, completion and load-error reporting.

Two placements (``kv_placement``). ``shared``: the KV cache itself is a shared region
(vLLM allocates it through ``get_mem_pool_context``; CPU engines) and the rank's
BackendClient actor moves blocks straight from and into it. ``staged``: the KV cache
lives anywhere (GPU, NPU, CPU); blocks go through a staging region
(:mod:`kvray.connector.staging`), gathered after the forward and scattered back before
it, in transfers of at most the staging region's size.

When ``wait_for_save`` runs the step's KV is written (CPU forwards are synchronous; on a
device the gather waits for the forward's event). Shared saves read the cache itself, so
a finished request's free is delayed until its saves completed (``request_finished``
returns True and ``get_finished`` reports it) and a preempted request's in-flight saves
are drained in ``handle_preemptions`` before its blocks can be reused.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvray.backends.base import KeyStatus
from kvray.connector.common import InstanceInfo, attach_pool
from kvray.connector.kv_geometry import check_uniform, geometry_tag, layer_geometry
from kvray.connector.metadata import BlockOp, KVRayMetadata
from kvray.connector.pp import split_by_stage, stage_ranges
from kvray.connector.shm_kv import SharedKVAllocator
from kvray.connector.staging import Stager
from kvray.connector.stats import KVRayConnectorStats
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
        handles = attach_pool(info.config)
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
        self._stages: list[tuple[int, int]] = []
        """Layer ranges per prefill PP stage when blocks are split (else empty)."""
        self._load_errors: set[int] = set()
        self.stats = KVRayConnectorStats()

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
        if self.info.split_stages:
            parts = self.info.config.layer_partition(self._num_layers)  # checks the sum
            planes = self._stager.planes_per_layer if self._stager else 1
            self._stages = [(lo * planes, hi * planes) for lo, hi in stage_ranges(parts)]
            logger.info("KVRayConnector: blocks split by prefill PP partition %s", parts)
        logger.info(
            "KVRayConnector worker rank %d: %d layers, %d bytes per block, %s placement, region %s",
            self.rank,
            self._num_layers,
            self._row_bytes,
            placement,
            self._region_spec.region_id,
        )

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
        """One batch, or one per prefill PP stage when blocks are split. Shared: the
        blocks' places in the KV cache; staged: staging slots ``first_slot..``."""
        hashes = [h for op in ops for h in op.block_hashes]
        if first_slot is None:
            assert self._layer_offsets is not None, "KVRayWorker used before register_kv_caches"
            block_ids = np.array([b for op in ops for b in op.block_ids], dtype=np.int64)
            offsets = self._layer_offsets[None, :] + block_ids[:, None] * self._block_stride
            lengths = np.full(offsets.shape, self._block_bytes, dtype=np.int64)
        else:
            assert self._stager is not None
            offsets, lengths = self._stager.offsets(first_slot, len(hashes))
        if not self._stages:
            keys = tuple(self.info.space.rank_key_strs(hashes, self.rank))
            return [TransferBatch(self._region_spec, keys, offsets, lengths)]
        parts = split_by_stage(
            self.info.space, self._tp_rank, hashes, offsets, lengths, self._stages
        )
        return [TransferBatch(self._region_spec, k, o, n) for k, o, n in parts]

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

    def handle_preemptions(self, meta: KVRayMetadata) -> None:
        refs = [r for rid in meta.preempted for r in self._saves_of.get(rid, ())]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self._call_timeout_s)
            self._reap_saves(block=False)

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for chunk in self._chunks(meta.loads):
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
        if failed:
            logger.warning(
                "rank %d: %d of %d pool blocks failed to load; reported to vLLM",
                self.rank,
                len(failed),
                len(block_ids),
            )

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or not meta.saves:
            return
        for chunk in self._chunks(meta.saves):
            rids = [op.req_id for op in chunk]
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
            refs = []
            for stage, batch in enumerate(self._batches(chunk, first)):
                ref = self._actor.put.remote(batch)
                refs.append(ref)
                # Blocks are counted once (stage 0); bytes by each stage's columns.
                row = int(batch.lengths[0].sum()) if len(batch) else 0
                self._save_refs[ref] = (rids, len(batch), stage == 0, row)
                for rid in rids:
                    self._saves_of[rid].add(ref)
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
        self._reap_saves(block=True)
        if self._allocator is not None:
            self._allocator.close()
        if self._stager is not None:
            if self._async_loads:  # the actor may still write into staging
                refs = [r for group in self._async_loads for r in group]
                ray.wait(refs, num_returns=len(refs), timeout=self._call_timeout_s)
            self._stager.close()
