"""The ``staged`` placement: a KV cache anywhere (CUDA, NPU, ordinary CPU memory) moves
through a staging region in shared memory that the rank's BackendClient actor reads and
writes.

Save: once the forward that wrote a step's blocks has finished (a device event recorded
on the compute stream, never a guess), each layer's blocks are gathered into staging on a
side stream, the copy is awaited, then one Ray call stores them. Load: one Ray call fills
staging, then the blocks are scattered into the cache on the side stream and the compute
stream waits for that before any layer reads them.

Staging is a fixed number of block *slots* (each one block of every layer), laid out
segment by segment (layer, then plane), so one step's blocks of one segment are one
contiguous run: one gather or scatter copy per segment and transfer. A transfer holds its
slots until its Ray call (and, for loads, the scatter) is done; a transfer larger than
staging is split into several (``Stager.capacity`` blocks at most each).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from kvray.connector.kv_geometry import (
    KVEntry,
    LayerGeometry,
    PlaneGeometry,
    check_uniform,
    layer_geometry,
    planes_of,
)
from kvray.errors import ConfigError
from kvray.shm import SharedRegion

logger = logging.getLogger(__name__)


class DeviceOps:
    """Streams, events and host-memory pinning of one device type. CPU copies are
    synchronous and need none of them; CUDA and NPU (torch_npu, imported lazily) have
    the same stream/event API."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = device.type
        self._mod: Any = None
        self._side: Any = None
        if self.kind == "cuda":
            self._mod = torch.cuda
        elif self.kind == "npu":  # pragma: no cover - needs Ascend hardware and torch_npu
            import torch_npu  # noqa: F401  (registers torch.npu)

            self._mod = torch.npu  # type: ignore[attr-defined]
        elif self.kind != "cpu":
            raise ConfigError(
                f"KVRayConnector: KV cache on device {device}: kvray moves KV caches on cpu, "
                "cuda and npu"
            )
        if self._mod is not None:
            self._side = self._mod.Stream(device=device)

    @property
    def synchronous(self) -> bool:
        return self._mod is None

    def pin(self, region: SharedRegion) -> bool:
        """Page-lock the staging region for DMA; False where that is not possible (then
        copies go through pageable memory: correct, slower)."""
        if self.kind == "cuda":
            rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                region.base_ptr, region.spec.size, 0
            )
            if int(rc) != 0:
                logger.warning("cudaHostRegister of the staging region failed (%s)", rc)
                return False
            return True
        return False

    def unpin(self, region: SharedRegion) -> None:
        if self.kind == "cuda":
            torch.cuda.cudart().cudaHostUnregister(region.base_ptr)  # type: ignore[no-untyped-call]

    def compute_mark(self) -> Any:
        """An event marking what is queued on the compute stream now (None on CPU)."""
        if self._mod is None:
            return None
        ev = self._mod.Event()
        ev.record(self._mod.current_stream(self.device))
        return ev

    def after_compute(self, mark: Any = None) -> AbstractContextManager[Any]:
        """Run the enclosed copies on the side stream, after what was queued on the
        compute stream at ``mark`` (default: everything queued so far, e.g. the forward
        that wrote the blocks)."""
        if self._mod is None:
            return nullcontext()
        self._side.wait_event(mark if mark is not None else self.compute_mark())
        return self._mod.stream(self._side)  # type: ignore[no-any-return]

    def side_done(self) -> Any:
        """An event marking what was queued on the side stream so far (None on CPU)."""
        if self._mod is None:
            return None
        ev = self._mod.Event()
        ev.record(self._side)
        return ev

    def compute_waits_for(self, ev: Any) -> None:
        if ev is not None:
            self._mod.current_stream(self.device).wait_event(ev)


class Stager:
    """Gathers blocks of a KV cache into staging slots and scatters them back."""

    def __init__(
        self,
        kv_caches: Mapping[str, KVEntry],
        num_blocks: int,
        staging_bytes: int | None,
        prefix: str,
        *,
        default_slots: int = 64,
        mixed: bool = False,
    ) -> None:
        """``staging_bytes`` (``kv_staging_size``) or, when None, ``default_slots``
        blocks of staging. ``mixed``: layers may differ in block geometry (a hybrid
        model's groups: attention blocks beside recurrent states), each layer's segments
        sized by its own; else they must share one."""
        if not kv_caches:
            raise ConfigError("KVRayConnector: the engine has no KV cache layers")
        layers = [planes_of(e) for e in kv_caches.values()]
        geometries = {n: layer_geometry(e, num_blocks, n) for n, e in kv_caches.items()}
        self.layer_geometries: list[LayerGeometry] = list(geometries.values())
        """Each layer's, in order."""
        self.geometry: LayerGeometry = (
            self.layer_geometries[0] if mixed else check_uniform(geometries)
        )
        """The layers' one geometry (``mixed``: the first layer's)."""
        if len({len(g.planes) for g in self.layer_geometries}) != 1:
            raise ConfigError(
                "KVRayConnector: KV cache layers differ in their number of planes; kvray "
                "stages models whose layers share one"
            )
        self.num_layers = len(layers)
        self._segs: list[tuple[torch.Tensor, PlaneGeometry]] = [
            (plane, g)
            for planes, geom in zip(layers, self.layer_geometries, strict=True)
            for plane, g in zip(planes, geom.planes, strict=True)
        ]
        """Segment (layer, plane) c = layer * planes + plane: its tensor and geometry."""
        devices = {plane.device for plane, _ in self._segs}
        if len(devices) != 1:
            raise ConfigError(f"KVRayConnector: KV cache layers on several devices {devices}")
        self.ops = DeviceOps(devices.pop())
        self.block_bytes = sum(g.nbytes for g in self.layer_geometries)
        """Bytes of one block, all layers: one staging slot."""
        if staging_bytes is None:
            staging_bytes = default_slots * self.block_bytes
        self.capacity = staging_bytes // self.block_bytes
        if self.capacity < 1:
            raise ConfigError(
                f"kv_staging_size {staging_bytes} bytes holds no block of this model "
                f"({self.block_bytes} bytes per block, all layers): raise kv_staging_size "
                f"to at least {self.block_bytes}"
            )
        self.region = SharedRegion.create(prefix, self.capacity * self.block_bytes)
        self.pinned = self.ops.pin(self.region)
        # Slot s of segment c is at seg_base[c] + s * seg_bytes[c].
        self.seg_bytes = np.array([g.nbytes for _, g in self._segs], dtype=np.int64)
        self.seg_base = np.concatenate([[0], np.cumsum(self.seg_bytes * self.capacity)[:-1]])
        raw = torch.from_numpy(self.region.array)
        self._views: list[torch.Tensor] = [
            raw[lo : lo + self.capacity * g.nbytes]
            .view(g.dtype)
            .view(self.capacity, *g.block_shape)
            for lo, (_, g) in zip(self.seg_base.tolist(), self._segs, strict=True)
        ]
        """Each segment's slots as ``(capacity, *block_shape)`` tensors over the region."""
        self._free = [(0, self.capacity)]
        """Free slot runs ``[lo, hi)``, sorted."""

    @property
    def columns(self) -> int:
        """Segments per block (layers x planes): the columns of a transfer's offsets."""
        return len(self.seg_bytes)

    @property
    def planes_per_layer(self) -> int:
        return len(self.geometry.planes)

    # ---- slots ---------------------------------------------------------------------------

    def reserve(self, n: int) -> int | None:
        """First slot of a free run of ``n`` slots (first fit), or None when no run is
        that long now (the caller waits for a transfer to release its slots)."""
        if not 0 < n <= self.capacity:
            raise ValueError(f"reserve({n}): 1..{self.capacity} slots")
        for i, (lo, hi) in enumerate(self._free):
            if hi - lo >= n:
                if hi - lo == n:
                    del self._free[i]
                else:
                    self._free[i] = (lo + n, hi)
                return lo
        return None

    def release(self, first: int, n: int) -> None:
        runs = sorted([*self._free, (first, first + n)])
        merged: list[tuple[int, int]] = []
        for lo, hi in runs:
            if merged and merged[-1][1] == lo:
                merged[-1] = (merged[-1][0], hi)
            else:
                assert not merged or merged[-1][1] < lo, "staging slots released twice"
                merged.append((lo, hi))
        self._free = merged

    @property
    def free_slots(self) -> int:
        return sum(hi - lo for lo, hi in self._free)

    def offsets(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(n, columns)`` byte offsets into the region and lengths of slots
        ``first .. first+n``: what a TransferBatch over them needs."""
        slots = np.arange(first, first + n, dtype=np.int64)
        offsets = self.seg_base[None, :] + slots[:, None] * self.seg_bytes[None, :]
        lengths = np.broadcast_to(self.seg_bytes, offsets.shape).copy()
        return offsets, lengths

    # ---- copies --------------------------------------------------------------------------

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.ops.device)

    def _columns(self, cols: tuple[int, int] | None) -> range:
        return range(*(cols or (0, self.columns)))

    def gather(
        self,
        block_ids: Sequence[int],
        first: int,
        cols: tuple[int, int] | None = None,
        *,
        wait: bool = True,
    ) -> Any:
        """Copy blocks ``block_ids`` (of every layer, or of segments ``cols``
        ``[lo, hi)``) into slots ``first..``, after the compute queued so far. With
        ``wait`` returns once staging holds them; else returns the event that marks it
        (None: already done, as on CPU)."""
        n = len(block_ids)
        idx = self._index(block_ids)
        with self.ops.after_compute():
            for c in self._columns(cols):
                (plane, g), view = self._segs[c], self._views[c]
                d = g.block_dim
                dst = view[first : first + n]
                src = plane.index_select(d, idx)
                if d:
                    src = src.movedim(d, 0)
                dst.copy_(src, non_blocking=not self.ops.synchronous)
        done = self.ops.side_done()
        if done is not None and wait:
            done.synchronize()  # the Ray call that follows reads staging
            return None
        return done

    def scatter(
        self,
        block_ids: Sequence[int],
        first: int,
        rows: Sequence[int],
        cols: tuple[int, int] | None = None,
        *,
        after: Any = None,
        wait: bool = True,
    ) -> Any:
        """Copy staging slots ``first + rows[i]`` into blocks ``block_ids[i]`` of every
        layer (or of segments ``cols``), after the compute queued at ``after`` (default:
        now); the compute stream waits for it. With ``wait`` returns once staging may be
        reused; else returns the event that marks it (None on CPU)."""
        if not block_ids:
            return None
        idx = self._index(block_ids)
        whole = list(rows) == list(range(len(rows)))
        src_rows = torch.tensor([first + r for r in rows], dtype=torch.long)
        with self.ops.after_compute(after):
            for c in self._columns(cols):
                (plane, g), view = self._segs[c], self._views[c]
                d = g.block_dim
                # All rows: the (pinned) slots themselves; a subset (some blocks failed to
                # load): a gathered host copy of the ones that loaded.
                src = view[first : first + len(rows)] if whole else view.index_select(0, src_rows)
                if not self.ops.synchronous:
                    src = src.to(self.ops.device, non_blocking=True)
                if d:
                    src = src.movedim(0, d)
                plane.index_copy_(d, idx, src)
        done = self.ops.side_done()
        self.ops.compute_waits_for(done)
        if done is not None and wait:
            done.synchronize()  # staging slots are free once the host-to-device copy ran
            return None
        return done

    def close(self) -> None:
        if self.pinned:
            self.ops.unpin(self.region)
            self.pinned = False
        self._views.clear()
        self.region.close()
