"""Worker side of KVRayConnector: the front vLLM's worker hooks call. It registers the
engine's KV cache with the rank's BackendClient (:mod:`kvray.connector.region`), then
hands each step's loads to :mod:`kvray.connector.loads` and its saves to
:mod:`kvray.connector.saves`, and reports what completed and which loads failed.

Two placements (``kv_placement``). ``shared``: the KV cache itself is a shared region
(vLLM allocates it through ``get_mem_pool_context``; CPU engines) and the rank's
BackendClient actor moves blocks straight from and into it. ``staged``: the KV cache
lives anywhere (GPU, NPU, CPU); blocks go through a staging region
(:mod:`kvray.connector.staging`, its slots in :mod:`kvray.connector.slots`), gathered
after the forward and scattered back before it, in transfers of at most the staging
region's size.

Every call to the pool goes through the typed handles of :mod:`kvray.remote`, waited
for through a :class:`~kvray.connector.calls.Waits`; a failed or late call is a
:class:`~kvray.errors.KVRayError`, and a failed load is reported to vLLM, never used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvray.connector.attach import attach_pool
from kvray.connector.calls import RayWaits, Waits
from kvray.connector.instance import InstanceInfo
from kvray.connector.load_policy import worker_applied_policy
from kvray.connector.loads import IDLE_WAIT_S, Loader
from kvray.connector.metadata import KVRayHandshake, KVRayMetadata
from kvray.connector.region import KVRegion
from kvray.connector.saves import Saver
from kvray.connector.shm_kv import SharedKVAllocator
from kvray.connector.slots import StagingSlots
from kvray.connector.stats import KVRayConnectorStats
from kvray.connector.timeline import StepClock, StepTimes
from kvray.errors import ConfigError
from kvray.index.lookup import Place
from kvray.naming import region_prefix
from kvray.store.channel import ChannelStore

if TYPE_CHECKING:
    from kvray.connector.calls import Transfers
    from kvray.connector.kv_geometry import KVEntry
    from kvray.launcher import PoolHandles
    from kvray.remote import Call, StoreHandle

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

    def __init__(
        self, info: InstanceInfo, pool: PoolHandles | None = None, waits: Waits | None = None
    ) -> None:
        """``pool`` and ``waits``: the pool's handles (attached from ``info`` when None)
        and how calls are waited for (Ray's when None); tests pass fakes."""
        self.info = info
        self._pool = pool if pool is not None else attach_pool(info.config, info.local_workers)
        self._waits: Waits = waits if waits is not None else RayWaits()
        self._call_timeout_s = self._pool.config.call_timeout_s
        self._pool_name = self._pool.config.name
        self.rank = -1
        self.geometries: dict[int, str] = {}
        """Instance rank -> the geometry part of the keys this worker stores for it."""
        self.places: dict[int, Place] = {}
        """Instance rank -> this worker's node and slot (it loads that rank's keys)."""
        self.load_failure_policy = info.load_failure_policy
        """What vLLM does with this connector's failed loads (the top level's, once the KV
        caches are registered)."""
        self._allocator: SharedKVAllocator | None = None
        self._region: KVRegion | None = None
        self._channel: ChannelStore | None = None
        """The node channel to this worker's BackendClient (``transfer_channel: node``)."""
        self._loads: Loader | None = None
        self._saves: Saver | None = None
        """Both set by ``register_kv_caches``."""
        self._meta: KVRayMetadata | None = None
        self._finishing: set[str] = set()
        """Finished requests whose blocks stay allocated until their saves ended."""
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
        self.rank = pp_rank * self.info.space.tp_size + tp_rank
        world = self._pool.config.world_size
        if local_rank >= world:
            raise ConfigError(
                f"this worker is local rank {local_rank} on its node, but kvray pool "
                f"{self._pool_name!r} has {world} client(s) per node (world_size): restart "
                f"the pool with `kvray up --world-size {local_rank + 1}` or more (the most "
                "engine workers any node runs)"
            )
        # This node's client of this device/rank: the KV bytes move through shared memory.
        store = self._pool.client(local_rank)
        store.probe().result(60)  # connect now, not on the first load
        # vLLM made its KV transfer group (the top-level connector) before this call.
        self.load_failure_policy = worker_applied_policy(self.info.load_failure_policy)
        if not kv_caches:
            raise ConfigError("KVRayConnector: the engine registered no KV cache layers")
        kv_caches = self._group_major(kv_caches)
        shm = self._allocator.region if self._allocator else None
        if shm is not None:
            region = self._region = KVRegion.shared(self.info, self.rank, shm, kv_caches)
            placement = "shared"
        elif self.info.config.kv_placement == "shared":
            raise ConfigError(
                "kv_placement is 'shared' but the KV cache is not in shared memory (vLLM did "
                "not allocate it through the connector's get_mem_pool_context: a GPU or NPU "
                "engine): set kv_placement to 'staged' or 'auto'"
            )
        else:
            prefix = f"{region_prefix(self._pool_name)}-stage"
            region = self._region = KVRegion.staged(self.info, self.rank, kv_caches, prefix)
            placement = "staged"
        region.split_blocks(list(kv_caches), tp_rank)
        region.use_kv_groups([len(g.layer_names) for g in self.info.groups], list(kv_caches))
        # The block geometry is in every key (kvray.keys): an engine whose bytes are
        # shaped otherwise (attention backend, platform, PP partition) never shares keys
        # with this one, whatever the pool remembers or forgot. The scheduler learns it
        # through vLLM's handshake metadata (get_handshake_metadata).
        self.geometries = region.rank_geometries(kv_caches)
        region.use_geometries(self.geometries)
        # Its blocks on SSD live in this node's slot's tier, whatever its TP/PP rank (TP
        # across nodes, DP ranks sharing a node): the scheduler's lookups ask that one.
        # (a TP replica names only itself: its stage's TP rank 0 names where its copy is)
        mine = [r for r in self.geometries if not (region.replica and r != self.rank)]
        self.places = dict.fromkeys(mine, Place(self._pool.node_id, local_rank))
        self.info = region.info
        # The client maps (every page of) the region now, not in the first transfer.
        store.map_region(region.spec).result(600)
        self._start_transfers(store, region)
        logger.info(
            "KVRayConnector worker rank %d: %d layers, %d bytes per block, %s placement, "
            "region %s, transfers over %s",
            self.rank,
            region.num_layers,
            region.row_bytes,
            placement,
            region.spec.region_id,
            "the node channel" if self._channel and self._channel.attached else "Ray calls",
        )

    def _group_major(self, kv_caches: Mapping[str, KVEntry]) -> Mapping[str, KVEntry]:
        """A hybrid model's layers in KV cache group order (each group's layers one run:
        its columns); vLLM's own order for one group. Every layer is in one group (the
        groups' layers may share one cache tensor: vLLM's hybrid allocator overlays them)."""
        groups = self.info.groups
        if len(groups) < 2:
            return kv_caches
        names = [n for g in groups for n in g.layer_names]
        missing = sorted(set(names) - set(kv_caches))
        extra = sorted(set(kv_caches) - set(names))
        if missing or extra:
            raise ConfigError(
                f"KVRayConnector: the KV cache groups name layers {missing} the engine did not "
                f"register, or it registered {extra} outside every group: kvray's bug"
            )
        return {n: kv_caches[n] for n in names}

    def handshake(self) -> KVRayHandshake | None:
        """What the scheduler side needs of this worker (None before registration)."""
        if not self.geometries:
            return None
        return KVRayHandshake(dict(self.geometries), dict(self.places), self.load_failure_policy)

    def _start_transfers(self, handle: StoreHandle, region: KVRegion) -> None:
        store: Transfers = handle
        if self.info.config.transfer_channel == "node":
            self._channel = ChannelStore(handle, self._call_timeout_s)
            self._channel.attach()
            store = self._channel
        slots = None
        if region.stager is not None:
            slots = StagingSlots(
                region.stager,
                self._waits,
                self._call_timeout_s,
                self.rank,
                in_flight=self._async_loads,
                progress=self._progress,
            )
        args = (store, self._waits, region, slots, self.stats, self._call_timeout_s)
        self._loads = Loader(*args)
        self._saves = Saver(*args)

    def _async_loads(self) -> list[Call[Any]]:
        return self._loads.async_calls() if self._loads is not None else []

    def _progress(self) -> None:
        """Account the calls that ended (staging full: a transfer waits for slots)."""
        if self._saves is not None:
            self._saves.reap(block=False)
        if self._loads is not None:
            self._loads.poll_async()

    # ---- per step ------------------------------------------------------------------------

    def bind(self, meta: KVRayMetadata) -> None:
        self._meta = meta
        region = self._region
        if region is not None and meta.generation != region.info.space.generation:
            region.use_generation(meta.generation)  # (every op of this step on is keyed so)
            self.info = region.info
        self._finishing.update(meta.delayed_frees)
        self._clock.bind(meta.step)
        if self._saves is not None:
            self._saves.bind(meta.saves, meta.step)

    def step_times(self) -> StepTimes | None:
        """This step's connector times, for the scheduler side (once per step)."""
        step = self._clock.step
        times = self._clock.times(self._saves.ended_through(step) if self._saves else step)
        if times is not None and times.load_wait_ms:
            self.stats.add("load_wait_us", int(times.load_wait_ms * 1e3))
        return times

    def handle_preemptions(self, meta: KVRayMetadata) -> None:
        if self._saves is not None:
            self._saves.drain(meta.preempted)

    def start_load_kv(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._loads is not None:
                self._loads.finish_layerwise()  # a step whose forward never reached wait_for_save
                if self._meta is not None:
                    self._loads.start(self._meta.loads, self._meta.async_loads)
        finally:
            self._flush()
            # Sync loads hold the forward back; async ones only cost their submission.
            waited = bool(self._meta and self._meta.loads)
            served = self._loads.take_served() if self._loads is not None else 0.0
            self._clock.loaded(time.perf_counter() - t0, waited=waited, served=served)

    def wait_for_layer_load(self, layer_name: str) -> None:
        t0 = time.perf_counter()
        if self._loads is not None and self._loads.wait_for_layer(layer_name):
            served = self._loads.take_served()
            self._clock.loaded(time.perf_counter() - t0, waited=True, served=served)

    def save_kv_layer(self, layer_name: str) -> None:
        if self._saves is not None:
            self._saves.save_layer(layer_name)
            self._flush()

    def _flush(self) -> None:
        """Send what the hook queued on the node channel: one message."""
        if self._channel is not None:
            self._channel.flush()

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._loads is not None and self._saves is not None:
                self._loads.finish_layerwise()
                self._saves.save_step()
        finally:
            self._flush()
            self._clock.saving(t0, time.perf_counter() - t0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.transfer_results()
        return sending or None, recving or None

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose saves ended (finished ones: their blocks may be freed), whose
        async loads ended, and which of those failed (a hybrid model's, whose failed loads
        vLLM takes per request)."""
        loads, saves = self._loads, self._saves
        if loads is not None and saves is not None:
            loads.finish_layerwise()
            saves.end_layerwise()
            self._flush()
            if self._meta is not None and self._meta.awaits_saves:
                saves.wait(IDLE_WAIT_S)
            saves.reap(block=False)
        sending = {rid for rid in self._finishing if saves is None or not saves.saving(rid)}
        self._finishing -= sending
        recving: set[str] = set()
        failed: set[str] = set()
        if loads is not None:
            if self._meta is not None and self._meta.idle:
                loads.wait_async(IDLE_WAIT_S)
            loads.poll_async()
            recving, failed = loads.finished()
            self._clock.async_served(loads.take_async_served(recving))
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loads.take_errors() if self._loads is not None else set()

    def shutdown(self) -> None:
        if self._loads is not None and self._saves is not None and self._waits.connected():
            # (Not connected: interpreter exit after Ray's own atexit shutdown, vLLM's
            # finalizer runs later; the calls are gone with Ray's session, and a call
            # would start a new one. Only this process's memory is left to release.)
            self._loads.finish_layerwise()
            self._saves.end_layerwise()
            self._saves.reap(block=True)
            pending = self._loads.async_calls()
            if self._region is not None and self._region.stager is not None and pending:
                self._waits.ready(pending, self._call_timeout_s, every=True)  # may still write
        self._close_memory()

    def _close_memory(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._allocator is not None:
            self._allocator.close()
        if self._region is not None:
            self._region.close()
