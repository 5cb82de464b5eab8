import asyncio
import dataclasses
import gc
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvray.errors import RegionError
from kvray.shm import RegionSpec, SharedRegion, orphaned_mappings, remove_leftovers
from kvray.transfer import TransferBatch


@pytest.fixture
def region():
    r = SharedRegion.create("kvray-unittest", 4096)
    yield r
    r.close()


def test_region_shared_between_mappings(region):
    other = SharedRegion.attach(region.spec)
    region.array[:4] = [1, 2, 3, 4]
    assert list(other.array[:4]) == [1, 2, 3, 4]
    assert other.base_ptr == other.array.ctypes.data != region.base_ptr  # (two mappings)
    other.close()
    with pytest.raises(RegionError, match="closed"):
        other.base_ptr  # noqa: B018 - a closed region has no address
    assert not region.stale()  # an attacher closing does not end the region
    assert not glob.glob("/dev/shm/kvray-unittest*")  # never a named file


def test_attach_errors(region):
    with pytest.raises(RegionError, match="another node"):
        SharedRegion.attach(dataclasses.replace(region.spec, node="elsewhere:0"))
    with pytest.raises(RegionError, match="descriptor says"):
        SharedRegion.attach(dataclasses.replace(region.spec, size=1 << 20))
    with pytest.raises(RegionError, match="names another file"):  # fd number reused
        SharedRegion.attach(dataclasses.replace(region.spec, inode=region.spec.inode + 1))
    gone = dataclasses.replace(region.spec, path="/proc/999999999/fd/3", owner_pid=999999999)
    with pytest.raises(RegionError, match="is gone"):
        SharedRegion.attach(gone)


def test_stale_once_creator_closes(region):
    other = SharedRegion.attach(region.spec)
    assert not other.stale()
    region.close()
    assert other.stale()
    assert list(other.array[:1]) == [0]  # the mapping itself stays valid until dropped
    other.close()
    with pytest.raises(RegionError, match="is gone"):
        SharedRegion.attach(region.spec)


_CREATOR = """
import json, sys, time
from kvray.shm import SharedRegion
r = SharedRegion.create("kvray-unittest-kv", 1 << 20)
r.array[:3] = [7, 8, 9]
s = r.spec
print(json.dumps([s.region_id, s.path, s.size, s.owner_pid, s.inode, s.node]), flush=True)
time.sleep(600)
"""


def test_sigkilled_creator_leaves_nothing():
    """However the creator dies, nothing stays: no file, and once the attacher drops its
    mapping (as RankStore's sweep does when it sees stale()), no memory either."""
    proc = subprocess.Popen([sys.executable, "-c", _CREATOR], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        spec = RegionSpec(*json.loads(proc.stdout.readline()))
        other = SharedRegion.attach(spec)
        assert list(other.array[:3]) == [7, 8, 9]
    finally:
        proc.kill()
        proc.wait(10)
    assert not glob.glob("/dev/shm/kvray-unittest-kv*")
    assert other.stale()
    assert orphaned_mappings("kvray-unittest-kv") == {os.getpid(): [spec.region_id]}
    other.close()
    gc.collect()
    assert orphaned_mappings("kvray-unittest-kv") == {}


def test_remove_leftovers_only_dead_owners(tmp_path):
    """Files that kvray versions before memory-file regions left behind."""
    live = tmp_path / f"kvray-p-{os.getpid()}-0"
    live.write_bytes(b"x")
    dead = tmp_path / "kvray-p-999999999-0"
    dead.write_bytes(b"x")
    dead_kv = tmp_path / "kvray-p-kv-999999998-0"  # an engine's KV cache region
    dead_kv.write_bytes(b"x")
    assert sorted(remove_leftovers("kvray-p", shm_dir=tmp_path)) == sorted(
        [dead.name, dead_kv.name]
    )
    assert live.exists()


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


def test_joined_batches_are_one_after_the_other_and_only_of_one_shape(region):
    two = TransferBatch(region.spec, ("a", "b"), np.array([[0, 1024], [512, 1536]]),
                        np.full((2, 2), 256))  # fmt: skip
    one = TransferBatch(region.spec, ("c",), np.array([[2048, 3072]]), np.full((1, 2), 128))
    both = two.join(one)
    assert both.keys == ("a", "b", "c")
    assert both.offsets.tolist() == [[0, 1024], [512, 1536], [2048, 3072]]
    assert list(both.key_nbytes()) == [512, 512, 256]
    single = TransferBatch.contiguous(region.spec, ["d"], [0], [8])
    with pytest.raises(RegionError, match="as many pieces per key"):
        two.join(single)
    other = dataclasses.replace(region.spec, region_id="other")
    with pytest.raises(RegionError, match="one region"):
        two.join(TransferBatch(other, ("e",), np.array([[0, 8]]), np.full((1, 2), 8)))


class SlowRegisterBackend:
    """FAKE backend for RankStore: registration yields to the event loop (as a real
    client's does), puts only record where they would read from."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.put_ptrs: list[int] = []
        """Of the transfers' puts (not the warm-up's)."""
        self.put_keys: list[str] = []
        self.removed: list[str] = []

    async def register_region(self, ptr: int, size: int) -> None:
        await asyncio.sleep(0.01)
        self.registered.append(ptr)

    async def unregister_region(self, ptr: int) -> None:
        self.registered.remove(ptr)

    async def put(self, keys, ptrs, sizes, *, overwrite=False):  # type: ignore[no-untyped-def]
        from kvray.backends.base import KeyStatus

        self.put_ptrs += [p[0] for p, k in zip(ptrs, keys) if not k.startswith("kvray-warmup")]
        self.put_keys += list(keys)
        return [KeyStatus.OK] * len(keys)

    async def remove(self, keys, *, force=False):  # type: ignore[no-untyped-def]
        from kvray.backends.base import KeyStatus

        self.removed += list(keys)
        return [KeyStatus.OK] * len(keys)


def test_concurrent_first_transfers_map_a_region_once(region):
    """Two saves of one new region at once (one per prefill PP stage) map and register it
    once: were each to map its own copy, the replaced one would be unmapped under the
    other's transfer (the BackendClient actor crashes)."""
    from kvray.store.rank_store import RankStore

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


def test_a_registered_region_warms_the_backend_up_with_one_put_it_removes(region):
    """The backend's first transfer sets up its connections (Mooncake: up to 400 ms on a
    busy host): one scratch put from the new region, removed at once, pays for it at
    registration instead of an engine's first save. It is not counted as a store."""
    from kvray.store.rank_store import RankStore

    backend = SlowRegisterBackend()
    store = RankStore(backend, 3)  # type: ignore[arg-type]
    asyncio.run(store.ensure_region(region.spec))
    (key,) = backend.put_keys
    assert key.startswith("kvray-warmup-3-") and backend.removed == [key]
    assert store.stats.put_keys == 0 and store.stats.removed == 0
    asyncio.run(store.ensure_region(region.spec))  # mapped already: no second warm-up
    assert backend.put_keys == [key]


def test_a_region_is_unmapped_only_after_its_transfers_ended(region):
    """A release (the region's engine died: the sweep) while a transfer still copies from
    the region waits for it: the backend's thread would fault on unmapped pages. Seen:
    an engine killed with saves in flight took its node's BackendClient down (SIGSEGV)."""
    from kvray.backends.base import KeyStatus
    from kvray.store.rank_store import RankStore

    backend = SlowRegisterBackend()
    store = RankStore(backend, 0)  # type: ignore[arg-type]
    batch = TransferBatch.contiguous(region.spec, ["a"], [0], [16])

    async def scenario() -> None:
        copying, finish = asyncio.Event(), asyncio.Event()

        async def slow_put(keys, ptrs, sizes, *, overwrite=False):  # type: ignore[no-untyped-def]
            if keys[0].startswith("kvray-warmup"):  # the region's registration
                return [KeyStatus.OK]
            copying.set()
            await finish.wait()
            return [KeyStatus.OK] * len(keys)

        backend.put = slow_put  # type: ignore[method-assign]
        put = asyncio.ensure_future(store.put(batch))
        await copying.wait()
        release = asyncio.ensure_future(store.release_region(region.spec.region_id))
        await asyncio.sleep(0.05)
        assert not release.done() and len(backend.registered) == 1, "released mid-transfer"
        finish.set()
        assert await put == [KeyStatus.OK]
        await asyncio.wait_for(release, 5)
        assert backend.registered == [] and store.stats.regions == 0

    asyncio.run(scenario())


def test_sweep_drops_a_dead_creators_region():
    """The store's reconcile loop unmaps and unregisters a region once its creator closed
    it (or died), without any further transfer: the memory goes back to the kernel."""
    from kvray.store.rank_store import REGION_SWEEP_S, RankStore

    backend = SlowRegisterBackend()
    store = RankStore(backend, 0)  # type: ignore[arg-type]
    region = SharedRegion.create("kvray-unittest-sweep", 4096)

    async def scenario() -> None:
        await store.put(TransferBatch.contiguous(region.spec, ["a"], [0], [16]))
        assert store.stats.regions == 1
        region.close()
        for _ in range(int(5 * REGION_SWEEP_S / 0.1)):
            if store.stats.regions == 0:
                break
            await asyncio.sleep(0.1)

    asyncio.run(scenario())
    assert store.stats.regions == 0 and backend.registered == []
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert "/memfd:kvray-unittest-sweep" not in maps.read()


def test_a_process_that_exited_unreaped_counts_as_gone():
    """A killed Ray worker stays a zombie until its raylet reaps it; what it left (a
    MemCache client conf, a region file) is stale already."""
    from kvray.shm import process_gone

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_gone(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while not process_gone(child.pid):  # exited, not reaped: a zombie
            assert time.monotonic() < deadline, "a killed, unreaped child never counted gone"
            time.sleep(0.01)
        assert os.path.exists(f"/proc/{child.pid}")  # still there, unreaped
    finally:
        child.kill()
        child.wait()
    assert process_gone(child.pid)
