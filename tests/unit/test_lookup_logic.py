from kvray.index.lookup import leading_hits


def test_leading_hits_needs_every_rank():
    # rank-major: rank 0 has blocks 0-2, rank 1 has blocks 0-1 and 3
    present = [True, True, True, False, True, True, False, True]
    assert leading_hits(present, 4, 2) == 2
    assert leading_hits([True] * 4, 4, 1) == 4
    assert leading_hits([False, True], 2, 1) == 0
    assert leading_hits([], 0, 3) == 0


class FakeExists:
    """FAKE backend: only ``exists``, over a set of keys the test fills; counts asks."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.asks = 0

    async def exists(self, keys: list[str]) -> list[bool]:
        self.asks += 1
        return [k in self.keys for k in keys]


def test_lookup_waits_for_blocks_a_prefill_reported():
    import asyncio

    from kvray.index.lookup import LookupService
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8", 1, 1)
    hashes = [bytes([i]) * 16 for i in range(4)]
    keys = space.rank_key_strs(hashes, 0)
    backend = FakeExists()
    service = LookupService(backend)  # type: ignore[arg-type]

    async def scenario() -> tuple[int, int, int, int]:
        async def prefill_saves() -> None:
            backend.keys.add(keys[0])
            await asyncio.sleep(0.05)
            backend.keys.update(keys[1:3])  # the last saves land

        no_wait = await service.lookup(space, hashes, 1.0)  # plain lookup: one ask
        asks = backend.asks
        saving = asyncio.ensure_future(prefill_saves())
        waited = await service.lookup(space, hashes, 1.0, want=3, wait_s=5.0)
        await saving
        # told 4, only 3 ever arrive: after wait_s it answers with what is there
        partial = await service.lookup(space, hashes, 1.0, want=4, wait_s=0.1)
        return no_wait, asks, waited, partial

    no_wait, asks, waited, partial = asyncio.run(scenario())
    assert (no_wait, asks) == ((0, "not_stored", 0), 1)
    assert waited == (3, "not_stored", 0) and backend.asks > asks + 2, (
        "asked again until 3 were there"
    )
    assert partial == (3, "not_stored", 0)
    assert service.stats.lookups == 3 and service.stats.lookup_hit_blocks == 6


class SlowOnceExists(FakeExists):
    """FAKE backend whose first ``exists`` answers after the lookup timeout."""

    async def exists(self, keys: list[str]) -> list[bool]:
        import asyncio

        if self.asks == 0:
            self.asks += 1
            await asyncio.sleep(0.5)
            return [False] * len(keys)
        return await super().exists(keys)


def test_a_slow_ask_does_not_end_a_prefill_wait():
    """A timed-out ask while waiting for a prefill's blocks is asked again; only a plain
    lookup (no wait) answers a slow ask as a miss."""
    import asyncio

    from kvray.index.lookup import LookupService
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8", 1, 1)
    hashes = [bytes([i]) * 16 for i in range(3)]
    backend = SlowOnceExists()
    backend.keys.update(space.rank_key_strs(hashes, 0))
    service = LookupService(backend)  # type: ignore[arg-type]
    waited = asyncio.run(service.lookup(space, hashes, 0.1, want=3, wait_s=5.0))
    assert waited == (3, "", 0) and service.stats.lookup_timeouts == 1

    plain = LookupService(SlowOnceExists())  # type: ignore[arg-type]
    assert asyncio.run(plain.lookup(space, hashes, 0.1)) == (0, "lookup_timeout", 0)
    assert plain.stats.lookup_timeouts == 1 and plain.stats.miss_lookup_timeout == 3


def test_layerwise_lookup_needs_every_group_and_asks_each_ranks_ssd():
    """Layer-wise keys: a block is a hit only when every rank has every layer group of
    it, in DRAM or in that rank's SSD tier (asked with that rank's keys only)."""
    import asyncio

    from kvray.index.lookup import LookupService, Place
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8", tp_size=2, pp_size=1, layer_groups=2)
    hashes = [bytes([i]) * 16 for i in range(3)]
    backend = FakeExists()
    every = set(space.lookup_key_strs(hashes))
    backend.keys = every - set(space.rank_key_strs(hashes[1:], 1, 1))  # rank 1 group 1: block 0
    ssd_asks: list[tuple[int, list[str]]] = []
    on_ssd = set(space.rank_key_strs(hashes[1:2], 1, 1))  # rank 1 group 1: block 1 on SSD

    async def lower(place: Place, keys: list[str]) -> list[bool]:
        ssd_asks.append((place, keys))
        return [k in on_ssd for k in keys]

    service = LookupService(backend, lower, node_id="n0")  # type: ignore[arg-type]
    # block 2: rank 1 group 1 lacks it, the other columns have it
    assert asyncio.run(service.lookup(space, hashes, 1.0)) == (
        2,
        "partial_ranks",
        1,
    )  # block 1: SSD
    assert [place for place, _ in ssd_asks] == [Place("n0", 1)]  # no placement: slot = rank
    assert set(ssd_asks[0][1]) == set(space.rank_key_strs(hashes[1:], 1, 1))
    assert service.stats.lookup_ssd_blocks == 1
    backend.keys = every - {space.rank_key_strs(hashes, 0, 0)[0]}  # rank 0 group 0: block 0
    assert asyncio.run(LookupService(backend).lookup(space, hashes, 1.0)) == (0, "partial_ranks", 0)  # type: ignore[arg-type]


def test_misses_are_named_from_the_pools_ledger():
    """The block after the leading hits names the miss: never stored, stored then gone
    (evicted), removed through kvray, present on some ranks only, or never stored while
    instances hashing the same model differently share the pool. All missed blocks of a
    lookup count under that reason."""
    import asyncio

    from kvray.index.ledger import Changes, Ledger, Seen, block_digest
    from kvray.index.lookup import LookupService
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8", tp_size=2)
    hashes = [bytes([i]) * 16 for i in range(4)]
    backend = FakeExists()
    backend.keys = set(space.rank_key_strs(hashes[:1], 0)) | set(space.rank_key_strs(hashes[:1], 1))
    ledger = Ledger()
    service = LookupService(backend, ledger=ledger)  # type: ignore[arg-type]

    def ask() -> tuple[int, str]:
        return tuple(asyncio.run(service.lookup(space, hashes, 1.0)))  # type: ignore[return-value]

    assert ask() == (1, "not_stored", 0)
    # rank 1's key of block 1 is the one the ledger knows: the reason is per block
    ledger.record(
        Changes.of([block_digest(space.rank_key_strs(hashes[1:2], 1)[0])], Seen.STORED, 1.0)
    )
    assert ask() == (1, "evicted", 0)
    ledger.record(
        Changes.of([block_digest(space.rank_key_strs(hashes[1:2], 0)[0])], Seen.REMOVED, 2.0)
    )
    assert ask() == (1, "removed", 0)
    backend.keys.add(space.rank_key_strs(hashes[1:2], 0)[0])
    assert ask() == (1, "partial_ranks", 0)
    backend.keys |= set(space.rank_key_strs(hashes[1:2], 1))
    service.mixed_hashing = {"m@float32-b16-h1x8"}
    assert ask() == (2, "other_fingerprint", 0)
    backend.keys |= set(space.lookup_key_strs(hashes))
    assert ask() == (4, "", 0)
    s = service.stats
    assert (s.miss_not_stored, s.miss_evicted, s.miss_removed) == (3, 3, 3)
    assert (s.miss_partial_ranks, s.miss_other_fingerprint) == (3, 2)
    assert s.lookup_blocks - s.lookup_hit_blocks == sum(
        v for k, v in s.misses().items() if k not in ("gone_at_load", "load_failed")
    )


def test_ledger_followers_catch_up_and_forget_the_oldest():
    from kvray.index.ledger import Changes, Ledger, Seen

    S, R = int(Seen.STORED), int(Seen.REMOVED)
    leader, follower = Ledger(capacity=4), Ledger(capacity=4)
    leader.record(Changes.rows_of([(1, S, 1.0), (2, S, 1.0), (3, S, 1.0)]))
    seq, entries, full = leader.since(0)
    assert (seq, full) == (3, False)
    follower.apply(entries, full)
    leader.record(Changes.rows_of([(2, R, 2.0)]))
    # a store reported late (another actor's flush) does not undo a later removal
    leader.record(Changes.rows_of([(2, S, 1.5)]))
    seq, entries, full = leader.since(seq)
    assert entries.rows() == [(2, R, 2.0), (2, S, 1.5)] and not full
    follower.apply(entries, full)
    assert [follower.state(d) for d in (1, 2, 3, 9)] == [
        Seen.STORED,
        Seen.REMOVED,
        Seen.STORED,
        Seen.NEVER,
    ]
    leader.record(Changes.of(range(10, 20), S, 3.0))  # past capacity: oldest forgotten
    assert len(leader) == 4 and leader.state(1) is Seen.NEVER and leader.state(19) is Seen.STORED
    _, entries, full = leader.since(seq)  # the log was trimmed past seq: the whole record
    assert full and sorted(d for d, _, _ in entries.rows()) == [16, 17, 18, 19]
    follower.apply(entries, full)
    assert follower.state(2) is Seen.NEVER and follower.state(17) is Seen.STORED


def test_the_ledgers_log_is_trimmed_inside_a_report_and_read_from_inside_one():
    """Reports are kept whole in the log; a reader's sequence number can fall inside one,
    and trimming to the capacity can cut one."""
    from kvray.index.ledger import Changes, Ledger, Seen

    S = int(Seen.STORED)
    ledger = Ledger(capacity=3)
    ledger.record(Changes.of([1, 2], S, 1.0))
    ledger.record(Changes.of([3, 4], S, 2.0))
    seq, entries, full = ledger.since(1)  # from inside the first report
    assert (seq, full) == (4, False) and entries.digests.tolist() == [2, 3, 4]
    ledger.record(Changes.of([5, 6, 7], S, 3.0))  # 7 > 2 x 3: trimmed to the last 3 entries
    assert ledger.since(4) == (7, ledger.since(4)[1], False)
    assert ledger.since(4)[1].digests.tolist() == [5, 6, 7]
    _, entries, full = ledger.since(3)  # before what the log still holds
    assert full and sorted(entries.digests.tolist()) == [5, 6, 7]
    ledger.record(Changes.of([], S, 4.0))  # an empty report changes nothing
    assert ledger.seq == 7
    # digests use all 64 bits, and the reports' columns survive a round trip as Ray sends them
    import pickle

    big = Changes.of([2**64 - 1, 2**63], Seen.REMOVED, 5.0)
    assert pickle.loads(pickle.dumps(big, protocol=5)).rows() == [
        (2**64 - 1, int(Seen.REMOVED), 5.0),
        (2**63, int(Seen.REMOVED), 5.0),
    ]


# ---- which SSD tier a lookup asks, per key column --------------------------------------


class FakeSsdTiers:
    """FAKE: the SSD offload actors of a cluster, by (node, slot): each holds the keys its
    worker stored. A place with no actor holds nothing (as the Lookup actor answers for
    an actor it cannot find); ``broken`` places fail like a dead actor."""

    def __init__(self) -> None:
        from kvray.index.lookup import Place

        self.keys: dict[Place, set[str]] = {}
        self.asks: list[Place] = []
        self.broken: set[Place] = set()

    async def exists(self, place, keys: list[str]) -> list[bool]:  # type: ignore[no-untyped-def]
        from kvray.errors import BackendUnavailableError

        self.asks.append(place)
        if place in self.broken:
            raise BackendUnavailableError(f"SsdOffload at {place}: pool actor unavailable")
        held = self.keys.get(place, set())
        return [k in held for k in keys]


def _ssd_only(space, hashes, where):  # type: ignore[no-untyped-def]
    """Blocks held ONLY on SSD (DRAM evicted): rank r's keys in the tier at where[r]."""
    from kvray.index.lookup import LookupService

    tiers = FakeSsdTiers()
    for rank, place in where.items():
        tiers.keys.setdefault(place, set()).update(space.rank_key_strs(hashes, rank))
    dram = FakeExists()  # empty: every block was evicted from DRAM after its offload
    return LookupService(dram, tiers.exists, node_id="A"), tiers  # type: ignore[arg-type]


def test_ssd_places_per_rank_follow_the_workers_placement():
    from kvray.index.lookup import Place, ssd_places

    # unknown (Pool API callers, workers that did not say): this node, slot = rank
    assert ssd_places(3, None, "A") == [Place("A", 0), Place("A", 1), Place("A", 2)]
    # TP=2 across nodes: rank 1's worker is slot 0 of node B
    placement = {0: Place("A", 0), 1: Place("B", 0)}
    assert ssd_places(2, placement, "A") == [Place("A", 0), Place("B", 0)]
    # a rank nobody placed: nothing on SSD its worker could load
    assert ssd_places(3, placement, "A") == [Place("A", 0), Place("B", 0), None]


def test_tp_across_nodes_asks_each_ranks_node():
    """TP=2, rank 0 on node A slot 0, rank 1 on node B slot 0 (the Lookup actor runs on
    A): rank 1's SSD blocks are on B's disk. Asked where each worker loads through, all
    hit; asked without the placement (this node, slot = rank: A's slot 1, which has no
    tier), rank 1's column misses."""
    import asyncio

    from kvray.index.lookup import Place
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8", tp_size=2)
    hashes = [bytes([i]) * 16 for i in range(3)]
    where = {0: Place("A", 0), 1: Place("B", 0)}
    service, tiers = _ssd_only(space, hashes, where)
    assert asyncio.run(service.lookup(space, hashes, 1.0, placement=where)) == (3, "", 3)
    assert sorted(tiers.asks) == [Place("A", 0), Place("B", 0)]
    assert service.stats.lookup_ssd_blocks == 3
    assert service.ssd_asks == {Place("A", 0): 1, Place("B", 0): 1}
    tiers.asks.clear()
    assert asyncio.run(service.lookup(space, hashes, 1.0)) == (0, "partial_ranks", 0)
    assert sorted(tiers.asks) == [Place("A", 0), Place("A", 1)]  # this node, slot = rank


def test_dp_ranks_on_one_node_ask_the_slot_their_worker_loads_through():
    """DP=2, TP=1 on one GPU node: DP rank 1's worker is TP rank 0 but loads through slot
    1 (vLLM's local rank of DP rank 1). Blocks it stored sit in slot 1's SSD tier: its
    lookup must ask slot 1 (hit), DP rank 0's must ask slot 0, whose worker could not load
    them (miss, not a hit that fails its load). Asking by TP rank alone, both would ask
    slot 0."""
    import asyncio

    from kvray.index.lookup import Place
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8")
    hashes = [bytes([i]) * 16 for i in range(4)]
    dp1, dp0 = {0: Place("A", 1)}, {0: Place("A", 0)}
    service, tiers = _ssd_only(space, hashes, dp1)
    assert asyncio.run(service.lookup(space, hashes, 1.0, placement=dp1)) == (4, "", 4)
    assert tiers.asks == [Place("A", 1)]
    assert asyncio.run(service.lookup(space, hashes, 1.0, placement=dp0)).hits == 0
    assert tiers.asks[-1] == Place("A", 0)
    assert asyncio.run(service.lookup(space, hashes, 1.0)).hits == 0  # before: slot 0


def test_an_unplaced_rank_or_a_failing_tier_is_a_miss_never_a_failed_lookup(caplog):
    """A rank without a place is not asked (its column is not on SSD); an SSD tier that
    fails (its node died) makes its keys misses, said once, while the DRAM answer and the
    other tiers still count."""
    import asyncio

    from kvray.index.lookup import Place
    from kvray.keys import KeySpace

    space = KeySpace("m", "float32-b16-h1x8", tp_size=2)
    hashes = [bytes([i]) * 16 for i in range(2)]
    where = {0: Place("A", 0), 1: Place("B", 0)}
    service, tiers = _ssd_only(space, hashes, where)
    assert asyncio.run(service.lookup(space, hashes, 1.0, placement={0: where[0]})) == (
        0,
        "partial_ranks",
        0,
    )
    assert tiers.asks == [Place("A", 0)]
    tiers.broken.add(Place("B", 0))
    for _ in range(2):
        assert asyncio.run(service.lookup(space, hashes, 1.0, placement=where)) == (
            0,
            "partial_ranks",
            0,
        )
    assert service.stats.lookup_errors == 0 and service.stats.lookup_timeouts == 0
    said = [r for r in caplog.records if "SSD tier of slot 0 on node B failed" in r.message]
    assert len(said) == 1, "said once, then only counted"
    # rank 1's blocks also in DRAM: a hit, whatever B's tier does
    service.backend.keys.update(space.rank_key_strs(hashes, 1))  # type: ignore[attr-defined]
    # (rank 0's column is still on A's SSD only: both blocks count as the SSD tier's)
    assert asyncio.run(service.lookup(space, hashes, 1.0, placement=where)) == (2, "", 2)
