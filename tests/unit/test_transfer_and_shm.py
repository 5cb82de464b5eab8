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
