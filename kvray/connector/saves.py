"""Worker side, save path: the blocks a step completed, from the KV cache into the pool.

When ``wait_for_save`` runs the step's KV is written (CPU forwards are synchronous; on a
device the gather waits for the forward's event), and the step's saves go as one batched
``put`` per transfer (per part when a block is several keys), not waited for: they are
reaped in later steps' ``get_finished``. Layer-wise: they are sent group by group from
``save_kv_layer`` once the group's last layer ran (staged: once its gather, queued on the
side stream after that layer, completed).

Shared saves read the cache itself, so a finished request's free is delayed until its
saves completed (the scheduler's ``request_finished`` returns True, and the worker
reports the request in ``get_finished`` once :meth:`Saver.saving` is False), and a
preempted request's in-flight saves are drained (:meth:`Saver.drain`) before its blocks
can be reused. A put that failed or did not store some keys counts them as
``save_failed_blocks``; the pool just lacks those blocks.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvray.backends.base import KeyStatus
from kvray.errors import KVRayError
from kvray.warn_once import WarnOnce

if TYPE_CHECKING:
    import numpy as np

    from kvray.connector.calls import Transfers, Waits
    from kvray.connector.metadata import BlockOp
    from kvray.connector.region import KVRegion, PartWork
    from kvray.connector.slots import StagingSlots
    from kvray.connector.stats import KVRayConnectorStats
    from kvray.remote import Call
    from kvray.transfer import TransferBatch

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _LayerwiseSave:
    """A step's saves, sent group by group as the forward completes their layers."""

    n: int
    """Blocks of the step (staging slots held from ``first``)."""
    first: int | None
    work: dict[int, PartWork]
    """Part (layer group) -> its batch and blocks; a hybrid model's step may have blocks
    of some KV cache groups only."""
    seen: dict[int, set[str]]
    """Layers of each part that ran."""
    gathered: dict[int, Any] = field(default_factory=dict)
    """Part -> gather event (staged on a device) of parts gathered, not yet sent."""
    calls: dict[int, Call[list[KeyStatus]]] = field(default_factory=dict)
    """Part -> its put."""


@dataclass(eq=False)
class _Put:
    """A put in flight."""

    call: Call[list[KeyStatus]]
    req_ids: list[str]
    blocks: int
    counts_blocks: bool
    """Blocks are counted once, by the put of part 0; bytes by each part's columns."""
    key_bytes: np.ndarray
    """Bytes of each key of this put (its part's columns; a hybrid model's put may hold
    several KV cache groups' keys)."""
    step: int
    """The scheduler step whose metadata asked for it."""


class Saver:
    """One worker's saves: whole steps and layer-wise, and which requests still save."""

    def __init__(
        self,
        store: Transfers,
        waits: Waits,
        region: KVRegion,
        slots: StagingSlots | None,
        stats: KVRayConnectorStats,
        timeout_s: float,
    ) -> None:
        self._store = store
        self._waits = waits
        self._region = region
        self._slots = slots
        self._stats = stats
        self._timeout_s = timeout_s
        self._rank = region.rank
        self._puts: dict[int, _Put] = {}
        """In flight, by ``id`` of the call."""
        self._puts_of: dict[str, set[int]] = defaultdict(set)
        """Request -> its puts in flight."""
        self._step: list[BlockOp] = []
        """The bound step's saves (emptied when they failed as a whole)."""
        self._step_no = 0
        self._lw: _LayerwiseSave | None = None
        self._warn = WarnOnce(logger, " (further ones are only counted)")

    def bind(self, saves: list[BlockOp], step: int) -> None:
        # A replica's blocks are TP rank 0's bytes, which that rank stores (one copy).
        self._step, self._step_no = ([] if self._region.replica else saves), step

    def ended_through(self, step: int) -> int:
        """The last step (up to ``step``, the current one) whose puts, and every earlier
        step's, all ended: the scheduler's lookups wait for saves in flight until then."""
        return min((p.step - 1 for p in self._puts.values()), default=step)

    def saving(self, req_id: str) -> bool:
        """Some put of the request's blocks is still in flight."""
        return req_id in self._puts_of

    def _send(self, ops: list[BlockOp], batch: TransferBatch, *, counts_blocks: bool) -> Call[Any]:
        rids = [op.req_id for op in ops]
        call = self._store.put(batch)
        self._puts[id(call)] = _Put(
            call, rids, len(batch), counts_blocks, batch.key_nbytes(), self._step_no
        )
        for rid in rids:
            self._puts_of[rid].add(id(call))
        return call

    # ---- whole steps ---------------------------------------------------------------------

    def save_step(self) -> None:
        """``wait_for_save``: send the step's saves (layer-wise: what the per-layer hooks
        did not send yet)."""
        if self._lw is not None:
            self.end_layerwise()
            return
        stager = self._region.stager
        for chunk in self._region.chunks(self._step):
            first = None
            block_ids = [b for op in chunk for b in op.block_ids]
            if self._slots is not None:
                assert stager is not None
                first = self._slots.reserve(len(block_ids))
                if first is None:
                    self._stats.add("save_failed_blocks", len(block_ids))
                    continue
                try:
                    self._region.gather(chunk, first)
                except BaseException:
                    stager.release(first, len(block_ids))
                    raise
            # (a block counts once: by the first part of its KV cache group's run)
            per_run = self._region.batches_per_run
            calls = [
                self._send(chunk, batch, counts_blocks=part % per_run == 0)
                for part, batch in enumerate(self._region.batches(chunk, first))
            ]
            if first is not None:
                assert self._slots is not None
                self._slots.hold(calls, first, len(block_ids))

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every put in flight to end (accounted by the next
        :meth:`reap`)."""
        calls = [p.call for p in self._puts.values()]
        if calls:
            self._waits.ready(calls, timeout_s, every=True)

    def reap(self, *, block: bool) -> None:
        """Account the puts that ended (``block``: wait up to ``call_timeout_s`` for all)
        and free the staging slots no call uses any more."""
        puts = list(self._puts.values())
        if puts:
            timeout = self._timeout_s if block else 0
            done = self._waits.ready([p.call for p in puts], timeout, every=True)
            for put in (p for p, d in zip(puts, done, strict=True) if d):
                self._account(put)
        if self._slots is not None:
            self._slots.release_ended()

    def _account(self, put: _Put) -> None:
        del self._puts[id(put.call)]
        stored = 0
        try:
            statuses = put.call.result(None)
            ok = sum(s is KeyStatus.OK for s in statuses)
            nbytes = put.key_bytes.tolist()
            stored = sum(n for n, s in zip(nbytes, statuses, strict=True) if s is KeyStatus.OK)
            if ok < len(statuses):  # the pool lacks these blocks: say why, once per kind
                failed = sorted({s.value for s in statuses if s is not KeyStatus.OK})
                self._warn(tuple(failed), "rank %d: %d of %d blocks not stored: %s", self._rank,
                           len(statuses) - ok, len(statuses), ", ".join(failed))  # fmt: skip
        except KVRayError as exc:
            logger.warning("rank %d: save of %d blocks failed: %s", self._rank, put.blocks, exc)
            ok = 0
        if put.counts_blocks:
            self._stats.add("saved_blocks", ok)
            self._stats.add("save_failed_blocks", put.blocks - ok)
        self._stats.add("saved_bytes", stored)
        for rid in put.req_ids:
            ids = self._puts_of.get(rid)
            if ids is not None:
                ids.discard(id(put.call))
                if not ids:
                    del self._puts_of[rid]

    def drain(self, req_ids: list[str]) -> None:
        """Wait (up to ``call_timeout_s``) for the puts of these requests (preempted:
        their blocks are about to be reused)."""
        calls = [self._puts[i].call for rid in req_ids for i in self._puts_of.get(rid, ())]
        if calls:
            self._waits.ready(calls, self._timeout_s, every=True)
            self.reap(block=False)

    # ---- layer-wise ----------------------------------------------------------------------

    def save_layer(self, layer_name: str) -> None:
        """``save_kv_layer``: send a layer group's puts once its last layer ran."""
        g = self._region.group_of.get(layer_name)
        if g is None or not self._step:
            return
        save = self._lw
        if save is None:
            if not self._region.fits(self._step):
                return  # save_step sends the step whole, in chunks
            save = self._start_layerwise(self._step)
            if save is None:
                return
        if g not in save.work:  # (a KV cache group this step saves nothing of)
            return
        save.seen[g].add(layer_name)
        if len(save.seen[g]) == self._region.group_len[g] and g not in save.calls:
            self._gather_group(save, g)
        self._send_gathered(save, block=False)

    def _start_layerwise(self, ops: list[BlockOp]) -> _LayerwiseSave | None:
        n = sum(len(op.block_ids) for op in ops)
        first = None
        if self._slots is not None:
            first = self._slots.reserve(n)
            if first is None:
                self._stats.add("save_failed_blocks", n)
                # The step's saves failed: neither later layers nor save_step retry.
                self._step = []
                return None
        work = self._region.layer_parts(ops, first)
        self._lw = _LayerwiseSave(n, first, work, {p: set() for p in work})
        return self._lw

    def _gather_group(self, save: _LayerwiseSave, g: int) -> None:
        """Queue the copy of group ``g``'s layers into staging (after the compute queued
        so far: its layers); shared placement: nothing to copy."""
        w = save.work[g]
        if w.first is None:
            save.gathered[g] = None
            return
        stager = self._region.stager
        assert stager is not None
        part = self._region.parts[g]
        save.gathered[g] = stager.gather(w.block_ids, w.first, (part.lo, part.hi), wait=False)

    def _send_gathered(self, save: _LayerwiseSave, *, block: bool) -> None:
        """Send the put of every gathered group whose copy completed (``block``: all)."""
        for g, ev in sorted(save.gathered.items()):
            if ev is not None and not block and not ev.query():
                continue
            if ev is not None:
                ev.synchronize()
            del save.gathered[g]
            w = save.work[g]
            counts = self._region.parts[g].group == 0  # (each block once: its first part)
            save.calls[g] = self._send(w.ops, w.batch, counts_blocks=counts)

    def end_layerwise(self) -> None:
        """End of the forward: gather and send what the per-layer hooks did not, then
        hold staging until every put ended."""
        save = self._lw
        if save is None:
            return
        self._lw = None
        for g in save.work:
            if g not in save.calls and g not in save.gathered:
                self._gather_group(save, g)
        self._send_gathered(save, block=True)
        if save.first is not None:
            assert self._slots is not None
            self._slots.hold(list(save.calls.values()), save.first, save.n)
