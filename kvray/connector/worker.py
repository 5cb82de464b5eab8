"""Worker side of KVRayConnector: the engine's KV cache as a shared region, one batched
Ray call per step for loads and one for saves, completion and load-error reporting.

CPU forwards are synchronous, so when ``wait_for_save`` runs the step's KV is written
and the save can go out without blocking the step. Its blocks stay valid: a finished
request's free is delayed until its saves completed (``request_finished`` returns True
and ``get_finished`` reports it), and a preempted request's in-flight saves are drained
in ``handle_preemptions`` before its blocks can be reused.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvray.backends.base import KeyStatus
from kvray.connector.common import InstanceInfo, attach_pool
from kvray.connector.metadata import BlockOp, KVRayMetadata
from kvray.connector.pp import split_by_stage, stage_ranges
from kvray.connector.shm_kv import SharedKVAllocator
from kvray.connector.stats import KVRayConnectorStats
from kvray.errors import ConfigError
from kvray.naming import region_prefix
from kvray.transfer import TransferBatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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
        self._num_layers = 0
        self._meta: KVRayMetadata | None = None
        self._save_refs: dict[Any, tuple[list[str], int, bool, int]] = {}
        self._saves_of: dict[str, set[Any]] = defaultdict(set)
        self._finishing: set[str] = set()
        self._async_loads: dict[tuple[Any, ...], tuple[list[BlockOp], int]] = {}
        self._tp_rank = 0
        self._stages: list[tuple[int, int]] = []
        """Layer ranges per prefill PP stage when blocks are split (else empty)."""
        self._load_errors: set[int] = set()
        self.stats = KVRayConnectorStats()

    # ---- setup ---------------------------------------------------------------------------

    def get_mem_pool_context(self) -> SharedKVAllocator:
        self._allocator = SharedKVAllocator(f"{region_prefix(self._pool_name)}-kv")
        return self._allocator

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        region = self._allocator.region if self._allocator else None
        layers = list(kv_caches.values())
        if region is None or not layers:
            raise ConfigError(
                "KVRayConnector: the KV cache is not in shared memory (vLLM did not allocate it "
                "through get_mem_pool_context); kvray's connector supports CPU KV caches"
            )
        base, end = region.base_ptr, region.base_ptr + region.spec.size
        strides = {t.stride(0) * t.element_size() for t in layers}
        if len(strides) != 1:
            raise ConfigError(
                f"KVRayConnector: layers have different block strides {sorted(strides)}"
            )
        self._block_stride = strides.pop()
        self._block_bytes = layers[0][0].numel() * layers[0].element_size()
        for t in layers:
            nbytes = t.shape[0] * self._block_stride
            assert base <= t.data_ptr() and t.data_ptr() + nbytes <= end, (
                "KVRayConnector: a KV layer lies outside the shared region: vLLM's allocation "
                "changed; kvray's SharedKVAllocator must be updated"
            )
            assert t[0].is_contiguous(), "KVRayConnector: a KV block is not contiguous"
        self._layer_offsets = np.array([t.data_ptr() - base for t in layers], dtype=np.int64)
        self._num_layers = len(layers)
        if self.info.split_stages:
            parts = self.info.config.layer_partition(len(layers))  # checks the sum
            self._stages = stage_ranges(parts)
            logger.info("KVRayConnector: blocks split by prefill PP partition %s", parts)
        self._region_spec = region.spec
        logger.info(
            "KVRayConnector worker rank %d: %d layers, %d bytes per block and layer, region %s",
            self.rank,
            len(layers),
            self._block_bytes,
            region.spec.region_id,
        )

    def _batches(self, ops: list[BlockOp]) -> list[TransferBatch]:
        """One batch, or one per prefill PP stage when blocks are split."""
        assert self._layer_offsets is not None, "KVRayWorker used before register_kv_caches"
        hashes = [h for op in ops for h in op.block_hashes]
        block_ids = np.array([b for op in ops for b in op.block_ids], dtype=np.int64)
        offsets = self._layer_offsets[None, :] + block_ids[:, None] * self._block_stride
        lengths = np.full(offsets.shape, self._block_bytes, dtype=np.int64)
        if not self._stages:
            keys = tuple(self.info.space.rank_key_strs(hashes, self.rank))
            return [TransferBatch(self._region_spec, keys, offsets, lengths)]
        parts = split_by_stage(
            self.info.space, self._tp_rank, hashes, offsets, lengths, self._stages
        )
        return [TransferBatch(self._region_spec, k, o, n) for k, o, n in parts]

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
        if meta.loads:
            batches = self._batches(meta.loads)
            n = len(batches[0])
            try:
                refs = [self._actor.get.remote(b) for b in batches]
                statuses = self._all_ok(ray.get(refs, timeout=self._call_timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("rank %d: load of %d blocks failed: %s", self.rank, n, exc)
                statuses = [KeyStatus.ERROR] * n
            self._account_loads(meta.loads, statuses)
        if meta.async_loads:
            batches = self._batches(meta.async_loads)
            group = tuple(self._actor.get.remote(b) for b in batches)
            self._async_loads[group] = (meta.async_loads, len(batches[0]))

    def _account_loads(self, ops: list[BlockOp], statuses: list[KeyStatus]) -> None:
        block_ids = [b for op in ops for b in op.block_ids]
        failed = {b for b, s in zip(block_ids, statuses, strict=True) if s is not KeyStatus.OK}
        self._load_errors |= failed
        self.stats.add("loaded_blocks", len(block_ids) - len(failed))
        self.stats.add(
            "loaded_bytes", (len(block_ids) - len(failed)) * self._block_bytes * self._num_layers
        )
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
        rids = [op.req_id for op in meta.saves]
        for stage, batch in enumerate(self._batches(meta.saves)):
            ref = self._actor.put.remote(batch)
            # Blocks are counted once (stage 0); bytes by each stage's layers.
            self._save_refs[ref] = (rids, len(batch), stage == 0, batch.lengths.shape[1])
            for rid in rids:
                self._saves_of[rid].add(ref)

    def _reap_saves(self, *, block: bool) -> None:
        refs = list(self._save_refs)
        if not refs:
            return
        ready, _ = ray.wait(
            refs, num_returns=len(refs), timeout=self._call_timeout_s if block else 0
        )
        for ref in ready:
            rids, n, first, layers = self._save_refs.pop(ref)
            try:
                statuses = ray.get(ref)
                ok = sum(s is KeyStatus.OK for s in statuses)
            except ray.exceptions.RayError as exc:
                logger.warning("rank %d: save of %d blocks failed: %s", self.rank, n, exc)
                ok = 0
            if first:
                self.stats.add("saved_blocks", ok)
                self.stats.add("save_failed_blocks", n - ok)
            self.stats.add("saved_bytes", ok * self._block_bytes * layers)
            for rid in rids:
                refs_of = self._saves_of.get(rid)
                if refs_of is not None:
                    refs_of.discard(ref)
                    if not refs_of:
                        del self._saves_of[rid]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._reap_saves(block=False)
        sending = {rid for rid in self._finishing if rid not in self._saves_of}
        self._finishing -= sending
        recving: set[str] = set()
        if self._async_loads:
            refs = [r for group in self._async_loads for r in group]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            for group in [g for g in self._async_loads if all(r in ready for r in g)]:
                ops, n = self._async_loads.pop(group)
                try:
                    statuses = self._all_ok(ray.get(list(group)))
                except ray.exceptions.RayError as exc:
                    logger.warning("rank %d: async load of %d blocks failed: %s", self.rank, n, exc)
                    statuses = [KeyStatus.ERROR] * n
                self._account_loads(ops, statuses)  # errors recorded before reporting done
                recving.update(op.req_id for op in ops)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._reap_saves(block=True)
        if self._allocator is not None:
            self._allocator.close()
