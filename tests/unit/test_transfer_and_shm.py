import asyncio
import os

import numpy as np
import pytest

from kvray.errors import RegionError
from kvray.shm import RegionSpec, SharedRegion, remove_leftovers
from kvray.transfer import TransferBatch


@pytest.fixture
def region(tmp_path):
    r = SharedRegion.create("kvray-unittest", 4096, shm_dir=tmp_path)
    yield r
    r.close()


def test_region_shared_between_mappings(region):
    other = SharedRegion.attach(region.spec)
    region.array[:4] = [1, 2, 3, 4]
    assert list(other.array[:4]) == [1, 2, 3, 4]
    other.close()
    assert os.path.exists(region.spec.path)  # only the owner unlinks
    region.close()
    assert not os.path.exists(region.spec.path)


def test_attach_errors(tmp_path, region):
    with pytest.raises(RegionError, match="same node"):
        SharedRegion.attach(RegionSpec("x", str(tmp_path / "missing"), 10, os.getpid()))
    too_big = RegionSpec(region.spec.region_id, region.spec.path, 1 << 20, os.getpid())
    with pytest.raises(RegionError, match="descriptor says"):
        SharedRegion.attach(too_big)


def test_stale_when_file_gone(region):
    assert not region.stale()
    os.unlink(region.spec.path)
    assert region.stale()


def test_remove_leftovers_only_dead_owners(tmp_path):
    live = SharedRegion.create("kvray-p", 4096, shm_dir=tmp_path)
    dead = tmp_path / "kvray-p-999999999-0"
    dead.write_bytes(b"x")
    dead_kv = tmp_path / "kvray-p-kv-999999998-0"  # an engine's KV cache region
    dead_kv.write_bytes(b"x")
    assert sorted(remove_leftovers("kvray-p", shm_dir=tmp_path)) == sorted(
        [dead.name, dead_kv.name]
    )
    assert os.path.exists(live.spec.path)
    live.close()


def test_batch_bounds(region):
    ok = TransferBatch.contiguous(region.spec, ["a", "b"], [0, 2048], [2048, 2048])
    assert ok.nbytes == 4096 and list(ok.key_nbytes()) == [2048, 2048]
    with pytest.raises(RegionError, match="past the end"):
        TransferBatch.contiguous(region.spec, ["a"], [4000], [200])
    with pytest.raises(RegionError, match="length > 0"):
        TransferBatch.contiguous(region.spec, ["a"], [0], [0])
    with pytest.raises(RegionError, match="must both be"):
        TransferBatch(
            region.spec, ("a", "b"), np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64)
        )


def test_multi_piece_batch(region):
    offsets = np.array([[0, 1024], [512, 1536]], dtype=np.int64)
    lengths = np.full((2, 2), 256, dtype=np.int64)
    batch = TransferBatch(region.spec, ("a", "b"), offsets, lengths)
    assert list(batch.key_nbytes()) == [512, 512]


class SlowRegisterBackend:
    """FAKE backend for RankStore: registration yields to the event loop (as a real
    client's does), puts only record where they would read from."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.put_ptrs: list[int] = []

    async def register_region(self, ptr: int, size: int) -> None:
        await asyncio.sleep(0.01)
        self.registered.append(ptr)

    async def unregister_region(self, ptr: int) -> None:
        self.registered.remove(ptr)

    async def put(self, keys, ptrs, sizes, *, overwrite=False):  # type: ignore[no-untyped-def]
        from kvray.backends.base import KeyStatus

        self.put_ptrs += [p[0] for p in ptrs]
        return [KeyStatus.OK] * len(keys)


def test_concurrent_first_transfers_map_a_region_once(region):
    """Two saves of one new region at once (one per prefill PP stage) map and register it
    once; before the fix each mapped its own copy and the replaced one was unmapped under
    the other's transfer (the BackendClient actor crashed)."""
    from kvray.rank_store import RankStore

    backend = SlowRegisterBackend()
    store = RankStore(backend, 0)  # type: ignore[arg-type]
    a = TransferBatch.contiguous(region.spec, ["a"], [0], [16])
    b = TransferBatch.contiguous(region.spec, ["b"], [16], [16])

    async def both() -> None:
        await asyncio.gather(store.put(a), store.put(b))

    asyncio.run(both())
    assert len(backend.registered) == 1 and store.stats.regions == 1
    base = backend.registered[0]
    assert sorted(backend.put_ptrs) == [base, base + 16], "both through the one mapping"
    asyncio.run(store.release_region(region.spec.region_id))
    assert backend.registered == []
