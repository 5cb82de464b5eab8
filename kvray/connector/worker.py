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
from kvray.connector.shm_kv import SharedKVAllocator
from kvray.connector.stats import KVRayConnectorStats
from kvray.errors import ConfigError
from kvray.naming import region_prefix
from kvray.transfer import TransferBatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _rank() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


class KVRayWorker:
    """One per vLLM worker (rank)."""

    def __init__(self, info: InstanceInfo) -> None:
        self.info = info
        handles = attach_pool(info.config, info.space.world_size)
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
        self._save_refs: dict[Any, tuple[list[str], int]] = {}
        self._saves_of: dict[str, set[Any]] = defaultdict(set)
        self._finishing: set[str] = set()
        self._async_loads: dict[Any, tuple[list[BlockOp], int]] = {}
        self._load_errors: set[int] = set()
        self.stats = KVRayConnectorStats()

    # ---- setup ---------------------------------------------------------------------------

    def get_mem_pool_context(self) -> SharedKVAllocator:
        self._allocator = SharedKVAllocator(f"{region_prefix(self._pool_name)}-kv")
        return self._allocator

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tp_rank, pp_rank = _rank()
        self.rank = pp_rank * self.info.space.tp_size + tp_rank
        self._actor = self._handles.backends[self.rank]
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
        self._region_spec = region.spec
        logger.info(
            "KVRayConnector worker rank %d: %d layers, %d bytes per block and layer, region %s",
            self.rank,
            len(layers),
            self._block_bytes,
            region.spec.region_id,
        )

    def _batch(self, ops: list[BlockOp]) -> TransferBatch:
        assert self._layer_offsets is not None, "KVRayWorker used before register_kv_caches"
        hashes = [h for op in ops for h in op.block_hashes]
        block_ids = np.array([b for op in ops for b in op.block_ids], dtype=np.int64)
        offsets = self._layer_offsets[None, :] + block_ids[:, None] * self._block_stride
        lengths = np.full(offsets.shape, self._block_bytes, dtype=np.int64)
        keys = tuple(self.info.space.rank_key_strs(hashes, self.rank))
        return TransferBatch(self._region_spec, keys, offsets, lengths)

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
            batch = self._batch(meta.loads)
            try:
                statuses = ray.get(self._actor.get.remote(batch), timeout=self._call_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("rank %d: load of %d blocks failed: %s", self.rank, len(batch), exc)
                statuses = [KeyStatus.ERROR] * len(batch)
            self._account_loads(meta.loads, statuses)
        if meta.async_loads:
            batch = self._batch(meta.async_loads)
            self._async_loads[self._actor.get.remote(batch)] = (meta.async_loads, len(batch))

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
        batch = self._batch(meta.saves)
        ref = self._actor.put.remote(batch)
        rids = [op.req_id for op in meta.saves]
        self._save_refs[ref] = (rids, len(batch))
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
            rids, n = self._save_refs.pop(ref)
            try:
                statuses = ray.get(ref)
                ok = sum(s is KeyStatus.OK for s in statuses)
            except ray.exceptions.RayError as exc:
                logger.warning("rank %d: save of %d blocks failed: %s", self.rank, n, exc)
                ok = 0
            self.stats.add("saved_blocks", ok)
            self.stats.add("saved_bytes", ok * self._block_bytes * self._num_layers)
            self.stats.add("save_failed_blocks", n - ok)
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
            refs = list(self._async_loads)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                ops, n = self._async_loads.pop(ref)
                try:
                    statuses = ray.get(ref)
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
