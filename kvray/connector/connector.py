"""KVRayConnector: vLLM's KVConnectorBase_V1 over a kvray pool.

A thin front: it builds the scheduler side or the worker side by role and forwards;
only :class:`~kvray.connector.metadata.KVRayMetadata` crosses between them.

    kv_transfer_config = {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool_name": "kvray"},
    }
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvray.connector.instance import instance_info
from kvray.connector.log_lines import log_through_vllm
from kvray.connector.metadata import KVRayMetadata
from kvray.connector.stats import KVRayConnectorStats, KVRayPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvray.connector.scheduler import KVRayScheduler
    from kvray.connector.worker import KVRayWorker


class KVRayConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid allocator on for hybrid models, whose KV
    cache groups the pool keys apart (:mod:`kvray.connector.kv_groups`); for a model of
    one group, ``request_finished_all_groups`` is ``request_finished``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_through_vllm()
        info = instance_info(vllm_config, kv_cache_config)
        self._scheduler: KVRayScheduler | None = None
        self._worker: KVRayWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvray.connector.scheduler import KVRayScheduler

            self._scheduler = KVRayScheduler(info)
        else:
            from kvray.connector.worker import KVRayWorker

            self._worker = KVRayWorker(info)

    @property
    def scheduler(self) -> KVRayScheduler:
        assert self._scheduler is not None, "scheduler-side method called on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> KVRayWorker:
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker

    # ---- worker side ---------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self.worker.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVRayMetadata), "foreign metadata for KVRayConnector"
        self.worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVRayMetadata), (
            "foreign metadata for KVRayConnector"
        )
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layer-wise: waits for (and, staged, scatters) the layer's group; otherwise loads
        # completed in start_load_kv.
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Layer-wise: sends a layer group's saves once its last layer ran; otherwise whole
        # blocks of all layers are saved in wait_for_save.
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.transfer_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.step_times()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # The worker's block geometries, for the scheduler side's keys.
        return self._worker.handshake() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished_all_groups(request, block_ids)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        counts = self.scheduler.hit_sources(request, num_external_tokens)
        return {CacheHitSource(k): v for k, v in counts.items()}

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.scheduler.loaded_groups()

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        # Sliding-window blocks stay allocated until their saves ended (kvray.connector.pins).
        self.scheduler.bind_block_pool(gpu_block_pool)

    def reset_cache(self) -> bool | None:
        # vLLM's reset_external: this engine's lookups and transfers move to a new
        # generation of its model's keys (the pool is shared: nothing else is removed).
        if self._scheduler is None:
            return None
        return self.scheduler.reset_cache()

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save dropped by a preemption is a future miss, never a
        # request's missing KV (PD through the pool recomputes what its prefill lacked).
        return False

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # Every (pp, tp) worker's: kvray keys blocks of every PP rank.
        self.scheduler.use_handshake(metadata.values())

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.use_handshake(metadata.values())

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---- stats ---------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        assert side is not None
        return side.stats.take()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVRayPromMetrics:
        return KVRayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVRayConnectorStats.from_dict(data)
