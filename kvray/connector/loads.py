"""Worker side, load path: blocks from the pool into the engine's KV cache.

A step's loads are one batched ``get`` per transfer (per part when a block is several
keys). Sync loads end before the step's forward. Async ones are a transfer per request,
polled in ``get_finished``: each request is reported done once its own blocks are in, so
vLLM computes it in the next step while the requests sent with it still load.
Layer-wise (``use_layerwise``): a step's sync loads are sent at once, one call per layer
group, and the forward waits for group ``g`` only in ``wait_for_layer_load`` of its first
layer (staged: then scatters that group), so later groups arrive while earlier layers
compute. A group the forward did not wait for (an engine that skips the per-layer hooks)
is reported as failed, never used.

A block loads only if every key of it did; one that did not (absent, corrupt, a failed
or late call) is left alone and reported through ``get_block_ids_with_load_errors``, so
vLLM recomputes it (or fails its request, under its ``fail`` policy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvray.backends.base import KeyStatus
from kvray.connector.region import all_ok
from kvray.errors import KVRayError

if TYPE_CHECKING:
    from kvray.connector.calls import Transfers, Waits
    from kvray.connector.metadata import BlockOp
    from kvray.connector.region import KVRegion
    from kvray.connector.slots import StagingSlots
    from kvray.connector.stats import KVRayConnectorStats
    from kvray.remote import Call

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02
"""How long a step in which no request computes waits for the oldest of its async loads to
end (or, when a lookup waits for this instance's own saves in flight, for those saves).
Such a step exists only for transfers; ending it at once makes vLLM run empty steps until
the loads are reported (each a scheduler pass, a worker round trip, and in a multiprocess
engine a 1 ms sleep), taking CPU from the BackendClient that serves them. A request that
arrives meanwhile waits at most this long to be scheduled; a longer load or save (a cold
SSD, a remote node) is then polled as before."""


def by_request(ops: list[BlockOp]) -> list[list[BlockOp]]:
    """``ops`` per request, in the order the requests first appear."""
    out: dict[str, list[BlockOp]] = {}
    for op in ops:
        out.setdefault(op.req_id, []).append(op)
    return list(out.values())


@dataclass(eq=False)
class _LayerwiseLoad:
    """A step's sync loads in flight, one call per layer group."""

    ops: list[BlockOp]
    block_ids: list[int]
    first: int | None
    calls: list[Call[list[KeyStatus]]]
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


@dataclass(eq=False)
class _AsyncLoad:
    """An async load in flight: its calls (one per part), ops, blocks, first staging
    slot (None when shared)."""

    calls: list[Call[list[KeyStatus]]]
    ops: list[BlockOp]
    n: int
    first: int | None


class Loader:
    """One worker's loads: sync, async and layer-wise, and the blocks that failed."""

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
        self._async: list[_AsyncLoad] = []
        self._loaded: set[str] = set()
        """Requests whose async loads (some of them) are done, to report once all are."""
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        """A hybrid model's requests whose (async) loads failed since the last
        :meth:`finished`: reported as failed receives."""
        self._lw: _LayerwiseLoad | None = None
        self._warned_late = False
        self._served_s = 0.0
        """Of the sync loads waited for since the last :meth:`take_served`: the time the
        BackendClient spent serving them (the slowest call of each wait)."""
        self._async_served: dict[str, float] = {}
        """Requests whose async loads ended: the BackendClient's time serving them (their
        slowest call), where the carrier reports it, until :meth:`take_async_served`."""

    def take_served(self) -> float:
        served, self._served_s = self._served_s, 0.0
        return served

    def take_async_served(self, rids: set[str]) -> dict[str, float]:
        """Of ``rids`` (reported ended now), the BackendClient's time serving each one's
        async load, where known (a request in several parts: its slowest)."""
        return {r: self._async_served.pop(r) for r in rids if r in self._async_served}

    def _count_served(self, calls: list[Call[list[KeyStatus]]]) -> None:
        self._served_s += max((c.served_s or 0.0 for c in calls), default=0.0)

    # ---- a step's loads ------------------------------------------------------------------

    def start(self, loads: list[BlockOp], async_loads: list[BlockOp]) -> None:
        """Send the step's loads; sync ones (not layer-wise) end here, before the async
        ones are sent: the whole step waits for the sync ones, so they have the
        BackendClient to themselves (sent beside them, a burst's async loads made the
        step's sync load as slow as all of them)."""
        if self._region.layerwise and loads and self._region.fits(loads):
            self._start_layerwise(loads)
            loads = []
        for chunk in self._region.chunks(loads):
            self._load_now(chunk)
        for ops in by_request(async_loads):
            for chunk in self._region.chunks(ops):
                self._send_async(chunk)

    def _reserve(self, ops: list[BlockOp], n: int) -> tuple[bool, int | None]:
        """(got slots, first slot): shared needs none; staged fails the ops when staging
        stays full."""
        if self._slots is None:
            return True, None
        first = self._slots.reserve(n)
        if first is None:
            self._account(ops, [KeyStatus.ERROR] * n)
            return False, None
        return True, first

    def _load_now(self, chunk: list[BlockOp]) -> None:
        n = sum(len(op.block_ids) for op in chunk)
        ok, first = self._reserve(chunk, n)
        if not ok:
            return
        batches = self._region.batches(chunk, first)
        calls: list[Call[list[KeyStatus]]] = []
        try:
            calls = [self._store.get(b) for b in batches]
            statuses = self._region.combine(self._waits.results(calls, self._timeout_s))
            self._count_served(calls)
        except KVRayError as exc:
            logger.warning("rank %d: load of %d blocks failed: %s", self._rank, n, exc)
            statuses = [KeyStatus.ERROR] * n
            if first is not None:
                assert self._slots is not None
                # A call still running may write these slots later: they stay held
                # until it ended, so no other transfer can be handed its bytes.
                self._slots.hold(calls, first, n)
                first = None
        if first is not None:
            self._scatter(chunk, first, statuses)
        self._account(chunk, statuses)

    def _send_async(self, chunk: list[BlockOp]) -> None:
        n = sum(len(op.block_ids) for op in chunk)
        ok, first = self._reserve(chunk, n)
        if not ok:
            self._loaded.update(op.req_id for op in chunk)
            return
        calls = [self._store.get(b) for b in self._region.batches(chunk, first)]
        self._async.append(_AsyncLoad(calls, chunk, n, first))

    def _scatter(self, ops: list[BlockOp], first: int, statuses: list[KeyStatus]) -> None:
        """Staged: the blocks that loaded, from their slots into the KV cache; frees the
        slots. A block that failed is left alone (vLLM recomputes it)."""
        stager = self._region.stager
        assert stager is not None
        n = sum(len(op.block_ids) for op in ops)
        try:
            ok = [i for i, s in enumerate(statuses) if s is KeyStatus.OK]
            self._region.scatter(ops, first, ok)
        finally:
            stager.release(first, n)

    def _account(self, ops: list[BlockOp], statuses: list[KeyStatus]) -> None:
        block_ids = [b for op in ops for b in op.block_ids]
        failed = {b for b, s in zip(block_ids, statuses, strict=True) if s is not KeyStatus.OK}
        grouped = self._region.kv_grouped
        if not grouped:
            self._errors |= failed
        ok_bytes = i = 0
        for op in ops:
            mine = statuses[i : i + len(op.block_ids)]
            i += len(mine)
            ok = sum(s is KeyStatus.OK for s in mine)
            ok_bytes += ok * self._region.row_bytes_of(op.group)
            if grouped and ok < len(mine):
                # vLLM takes a hybrid model's failed load per request only (async loads).
                self._failed_reqs.add(op.req_id)
        self._stats.add("loaded_blocks", len(block_ids) - len(failed))
        self._stats.add("loaded_bytes", ok_bytes)
        self._stats.add("load_failed_blocks", len(failed))
        gone = {b for b, s in zip(block_ids, statuses, strict=True) if s is KeyStatus.NOT_FOUND}
        bad = {b for b, s in zip(block_ids, statuses, strict=True) if s is KeyStatus.CORRUPT}
        self._stats.add("miss_gone_at_load", len(gone))
        self._stats.add("miss_corrupt", len(bad))
        self._stats.add("miss_load_failed", len(failed - gone - bad))
        if failed:
            logger.warning(
                "rank %d: %d of %d pool blocks failed to load; reported to vLLM",
                self._rank,
                len(failed),
                len(block_ids),
            )

    # ---- async loads ---------------------------------------------------------------------

    def async_calls(self) -> list[Call[Any]]:
        return [c for load in self._async for c in load.calls]

    def wait_async(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the oldest async load in flight to end (accounted
        by the next :meth:`poll_async`): its request can compute in the next step while
        the later ones still load."""
        if self._async:
            self._waits.ready(self._async[0].calls, timeout_s, every=True)

    def poll_async(self) -> None:
        """Account (and, staged, scatter) every async load whose calls are all done."""
        if not self._async:
            return
        calls = self.async_calls()
        done = self._waits.ready(calls, 0, every=True)
        ended = {id(c) for c, d in zip(calls, done, strict=True) if d}
        finished = [ld for ld in self._async if all(id(c) in ended for c in ld.calls)]
        self._async = [ld for ld in self._async if ld not in finished]
        for load in finished:
            times = [c.served_s for c in load.calls]
            if times and None not in times:
                served = max(t for t in times if t is not None)
                for rid in {op.req_id for op in load.ops}:
                    self._async_served[rid] = max(self._async_served.get(rid, 0.0), served)
            try:
                statuses = self._region.combine(self._waits.results(load.calls, None))
            except KVRayError as exc:
                logger.warning(
                    "rank %d: async load of %d blocks failed: %s", self._rank, load.n, exc
                )
                statuses = [KeyStatus.ERROR] * load.n
            if load.first is not None:
                self._scatter(load.ops, load.first, statuses)
            self._account(load.ops, statuses)  # errors recorded before reporting done
            self._loaded.update(op.req_id for op in load.ops)

    def finished(self) -> tuple[set[str], set[str]]:
        """Requests whose async loads all ended since the last call, and those of them
        whose loads failed (a hybrid model's; others' failures are block ids)."""
        # A request whose blocks were cut into several staged transfers is done when the
        # last of them is.
        pending = {op.req_id for load in self._async for op in load.ops}
        done = self._loaded - pending
        self._loaded -= done
        failed = self._failed_reqs & done
        self._failed_reqs -= failed
        return done, failed

    def take_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call (vLLM recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors

    # ---- layer-wise ----------------------------------------------------------------------

    def _start_layerwise(self, ops: list[BlockOp]) -> None:
        block_ids = [b for op in ops for b in op.block_ids]
        ok, first = self._reserve(ops, len(block_ids))
        if not ok:
            return
        calls = [self._store.get(b) for b in self._region.batches(ops, first)]
        load = _LayerwiseLoad(ops, block_ids, first, calls)
        if self._region.stager is not None:
            # Scatters wait only for what was queued before this step, not for the layers
            # before them: the blocks they fill are not read earlier in the forward.
            load.scattered = self._region.stager.ops.compute_mark()
        self._lw = load

    def wait_for_layer(self, layer_name: str) -> bool:
        """Wait for (staged: and scatter) the group of ``layer_name`` when it is the
        group's first layer; whether it waited."""
        load = self._lw
        g = self._region.group_of.get(layer_name)
        if load is None or g is None or len(load.statuses) > g:
            return False
        while len(load.statuses) <= g:
            self._finish_group(load)
        if len(load.statuses) == len(self._region.parts):
            load.on_time = True
        return True

    def _finish_group(self, load: _LayerwiseLoad, *, scatter: bool = True) -> None:
        """Wait for the next group's call; staged: scatter the blocks it loaded into
        that group's layers (queued on the side stream, the compute stream waits)."""
        g = len(load.statuses)
        try:
            statuses = load.calls[g].result(self._timeout_s)
            self._count_served([load.calls[g]])
        except KVRayError as exc:
            logger.warning(
                "rank %d: load of layer group %d (%d blocks) failed: %s",
                self._rank,
                g,
                load.n,
                exc,
            )
            statuses = [KeyStatus.ERROR] * load.n
            load.failed_call = True
        load.statuses.append(statuses)
        stager = self._region.stager
        if scatter and load.first is not None and not load.failed_call:
            assert stager is not None
            rows = [i for i, st in enumerate(statuses) if st is KeyStatus.OK]
            part = self._region.parts[g]
            if rows:
                done = stager.scatter(
                    [load.block_ids[i] for i in rows],
                    load.first,
                    rows,
                    (part.lo, part.hi),
                    after=load.scattered,
                    wait=False,
                )
                load.scattered = done if done is not None else load.scattered

    def finish_layerwise(self) -> None:
        """After the forward: account the step's layer-wise loads and free their staging.
        Groups the forward did not wait for are waited for here and reported failed."""
        load = self._lw
        if load is None:
            return
        self._lw = None
        while len(load.statuses) < len(self._region.parts):
            self._finish_group(load, scatter=False)
        statuses = all_ok(load.statuses)
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
                    self._rank,
                )
        if load.first is not None:
            assert self._slots is not None
            if load.scattered is not None:
                load.scattered.synchronize()  # queued copies read the slots
            if load.failed_call:
                # A call that failed may still write these slots: held until it ended.
                self._slots.hold(load.calls, load.first, load.n)
            else:
                self._slots.stager.release(load.first, load.n)
        self._account(load.ops, statuses)
