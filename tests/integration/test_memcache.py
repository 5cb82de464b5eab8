"""MemCache against its real MetaService: what runs without the Ascend driver.

Real here: the MetaService (started by a fixture on loopback), the lookup client kvray
uses on the scheduler side (``init(0, init_bm=False)``: contributes no memory) and the
Lookup actor on Ray. MemCache's data path (a client that contributes memory) needs the
Ascend driver, which this machine lacks: the contract suite runs the adapter against a
FAKE of it (tests/fakes/memcache.py), and the real data-path test below is skipped.
"""

from __future__ import annotations

import glob

import numpy as np
import pytest
import ray

from kvray.backends.base import KeyStatus
from kvray.config import MemcacheConfig, MemcacheMetaConfig, PoolConfig
from kvray.errors import BackendUnavailableError
from kvray.keys import KeySpace, KVLayout, chain_block_hashes
from kvray.servers.mmc_meta import MetaService

pytestmark = pytest.mark.integration
NPU = bool(glob.glob("/dev/davinci[0-9]*"))


@pytest.fixture(scope="module")
def meta():
    """A real MemCache MetaService (one per host: this module's tests share it)."""
    service = MetaService(MemcacheMetaConfig(lease_ttl_ms=2000), name="test")
    service.start()
    yield service
    home = service.home
    service.stop()
    assert not service.alive() and not home.exists()


def client_config(meta: MetaService, **kw) -> MemcacheConfig:
    return MemcacheConfig(
        meta_service_url=meta.meta_service_url,
        config_store_url=meta.config_store_url,
        protocol="host_tcp",
        dram_size="64MB",
        **kw,
    )


def lookup_client(meta: MetaService):
    from kvray.backends.memcache import MemcacheBackend

    return MemcacheBackend(client_config(meta), contribute_memory=False)


def test_meta_service_health_and_metrics(meta):
    doc = meta.health()
    assert doc is not None and doc["service_ready"] is True and doc["status"] == "ok"


async def test_lookup_client_against_the_real_meta_service(meta):
    b = lookup_client(meta)
    assert await b.health()
    keys = ["missing-1", "kvray@float16-b16-h2x64@tp0@pp0@" + "ab" * 32, "x" * 300]
    # The 300-character key is encoded to fit MemCache's 256: every answer is a real "no".
    assert await b.exists(keys) == [False, False, False]
    assert await b.exists([]) == []
    assert await b.remove(keys[:2]) == [KeyStatus.NOT_FOUND] * 2
    info = b.info()
    assert info["meta_service_url"] == meta.meta_service_url and info["segment_bytes"] == 0
    await b.close()


async def test_data_client_needs_the_ascend_driver_and_leaves_the_process_usable(meta):
    """On this machine a client that contributes memory fails with a clear error, and the
    process-wide MemCache client is reset so that a lookup client still connects."""
    if NPU:
        pytest.skip("an Ascend NPU is present: the data client initialises there")
    from kvray.backends.memcache import MemcacheBackend

    with pytest.raises(BackendUnavailableError, match="needs the Ascend driver"):
        MemcacheBackend(client_config(meta), contribute_memory=True)
    b = lookup_client(meta)
    assert await b.exists(["after-failed-init"]) == [False]
    await b.close()


def test_lookup_actor_on_ray_against_the_real_meta_service(ray_cluster, meta):
    from kvray.actors.lookup import LookupActor

    cfg = PoolConfig.from_dict(
        {
            "name": "mmclookup",
            "backend": "memcache",
            "detached": False,
            "memcache": client_config(meta).model_dump(),
        },
        environ={},
    )
    actor = (
        ray.remote(LookupActor)
        .options(namespace="kvray-test")
        .remote(cfg.model_dump_json(), meta.meta_service_url)
    )
    try:
        space = KeySpace("mmc", KVLayout("float16", 16, 2, 64).tag(), tp_size=2)
        hashes = chain_block_hashes(list(range(160)), 16)
        assert ray.get(actor.lookup.remote(space, hashes, 5.0)) == (0, "not_stored", 0)
        assert ray.get(actor.lookup.remote(space, [], 5.0)) == (0, "", 0)
        stats = ray.get(actor.snapshot.remote())["stats"]
        assert stats["lookups"] == 2 and stats["lookup_blocks"] == 10
        assert stats["miss_not_stored"] == 10
        assert stats["lookup_errors"] == 0 and stats["lookup_timeouts"] == 0
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)


async def test_meta_service_killed_then_restarted(meta):
    """Real failure handling: a dead MetaService is an error at once (-3014), and the
    client reconnects by itself once it is back on the same address."""
    import time

    b = lookup_client(meta)
    assert await b.exists(["k"]) == [False]
    meta.kill()
    with pytest.raises(BackendUnavailableError, match="unreachable or dropped"):
        await b.exists(["k"])
    assert not await b.health()
    meta.restart()
    deadline = time.monotonic() + 40
    while not await b.health():
        assert time.monotonic() < deadline, "client did not reconnect to the restarted service"
        time.sleep(0.5)
    assert await b.exists(["k"]) == [False]
    await b.close()


@pytest.mark.skipif(
    not NPU,
    reason="MemCache's data path (init_bm=True: batch_put_from_layers / batch_get_into_layers) "
    "needs the Ascend driver; this machine has none, so it has not run here",
)
async def test_real_data_path_round_trip(meta):
    from kvray.backends.memcache import MemcacheBackend

    b = MemcacheBackend(client_config(meta, protocol="device_rdma"), contribute_memory=True)
    src = np.random.default_rng(0).integers(0, 256, (4, 1 << 16), dtype=np.uint8)
    dst = np.zeros_like(src)
    await b.register_region(src.ctypes.data, src.nbytes)
    await b.register_region(dst.ctypes.data, dst.nbytes)
    keys = [f"npu-{i}" for i in range(4)]
    ptrs = [[row.ctypes.data] for row in src]
    assert await b.put(keys, ptrs, [[1 << 16]] * 4) == [KeyStatus.OK] * 4
    assert (
        await b.get(keys, [[row.ctypes.data] for row in dst], [[1 << 16]] * 4) == [KeyStatus.OK] * 4
    )
    assert np.array_equal(src, dst)
    await b.close()
