"""Backend servers that die and come back (issue 16, item 4), with real servers: an
external ``mooncake_master`` and datasystem worker killed under a running pool, and the
pool's own embedded server killed. While a server is gone every call ends in a clear
error within the pool's timeouts (a lookup is a miss, by reason ``lookup_error``); once it
listens again on the same address the same pool serves again, with no restart of the pool
or its clients; blocks the dead server held are misses, never other bytes.

Not run: MemCache's MetaService. It starts here, but a MemCache client's data path needs
the Ascend driver, so there is no client to reconnect (the supervisor that restarts an
embedded MetaService is the same code as for the other two)."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import numpy as np
import pytest
import ray

from kvray.errors import KVRayError
from kvray.keys import KeySpace, KVLayout, chain_block_hashes
from kvray.naming import manager_name

from .conftest import small_config

pytestmark = pytest.mark.integration

BACK_S = 60.0
"""How long a test waits for the pool to serve again once its server is back (measured:
Mooncake clients mount their segments on a restarted master within ~1 s; a datasystem
worker serves as soon as it listens)."""
SPACE = KeySpace("recovery", KVLayout("float16", 16, 8, 128).tag())


def _block(v: int) -> np.ndarray:
    return np.full(8192, v, np.uint8)


def _serves(pool, key: str, v: int) -> bool:  # type: ignore[no-untyped-def]
    try:
        pool.put([key], [_block(v)])
        (got,) = pool.get([key], shape=(8192,), dtype=np.uint8)
    except KVRayError:
        return False
    return got is not None and bool((got == v).all())


def _wait_serving(pool, tag: str) -> int:  # type: ignore[no-untyped-def]
    """Poll with fresh keys until a put and get round-trip; returns the tries it took."""
    deadline = time.monotonic() + BACK_S
    tries = 0
    while True:
        tries += 1
        if _serves(pool, f"{tag}-{tries}", tries % 256):
            return tries
        assert time.monotonic() < deadline, f"the pool does not serve {BACK_S} s after restart"
        time.sleep(0.2)


def _check_down(pool, cfg) -> None:  # type: ignore[no-untyped-def]
    """Every call while the server is gone: an error naming the server, within the
    pool's call timeout; a lookup: no hits, reason lookup_error."""
    for call in (
        lambda: pool.put(["down-put"], [_block(9)]),
        lambda: pool.get(["before"], shape=(8192,), dtype=np.uint8),
    ):
        started = time.monotonic()
        with pytest.raises(KVRayError) as err:
            call()
        assert time.monotonic() - started < cfg.call_timeout_s
        assert pool.server_address in str(err.value), str(err.value)
    hashes = list(chain_block_hashes(list(range(64)), 16))
    assert pool.lookup_why(SPACE, hashes) == (0, "lookup_error")


def _check_back(pool) -> None:  # type: ignore[no-untyped-def]
    _wait_serving(pool, "back")
    (old,) = pool.get(["before"], shape=(8192,), dtype=np.uint8)
    assert old is None  # the dead server's blocks are misses, not other bytes
    assert _serves(pool, "after", 42)


@pytest.mark.timeout(240)
def test_external_mooncake_master_dies_and_comes_back(ray_cluster):
    from kvray import Pool
    from kvray.config import MooncakeMasterConfig
    from kvray.servers.mooncake_master import MooncakeMaster

    with tempfile.TemporaryDirectory(prefix="kvray-test-ext-master-") as logs:
        master = MooncakeMaster(MooncakeMasterConfig(client_ttl_s=2), logs)
        master.start()
        cfg = small_config(master.address, world_size=1, call_timeout_s=20)
        pool = Pool.start(cfg)
        try:
            assert _serves(pool, "before", 1)
            master.kill()
            _check_down(pool, cfg)
            master.restart()  # what the operator (or a process supervisor) does
            _check_back(pool)
        finally:
            pool.shutdown()
            master.stop()


@pytest.mark.timeout(240)
def test_external_datasystem_worker_dies_and_comes_back(ray_cluster):
    from kvray import Pool
    from kvray.config import DatasystemWorkerConfig
    from kvray.servers.datasystem import DatasystemWorker

    worker = DatasystemWorker(
        DatasystemWorkerConfig(shared_memory_size="128MB", threads=2), name="recovery"
    )
    worker.start()
    cfg = small_config(
        None,
        backend="yuanrong",
        world_size=1,
        call_timeout_s=20,
        yuanrong={"worker_address": worker.address},
    )
    pool = Pool.start(cfg)
    try:
        assert _serves(pool, "before", 1)
        worker.kill()
        _check_down(pool, cfg)
        worker.restart()
        _check_back(pool)
    finally:
        pool.shutdown()
        worker.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mooncake", "yuanrong"])
def test_the_pool_restarts_its_embedded_server_on_the_same_address(ray_cluster, backend):
    from kvray import Pool

    cfg = small_config(None, backend=backend, world_size=1)
    pool = Pool.start(cfg)
    manager = ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
    try:
        assert _serves(pool, "before", 1)
        spec = ray.get(manager.spec.remote())
        assert spec.server_restarts == 0
        os.kill(spec.server_pid, signal.SIGKILL)  # a crash (or the OOM killer)
        deadline = time.monotonic() + BACK_S
        while True:
            now = ray.get(manager.spec.remote())
            if now.server_restarts == 1 and now.server_alive:
                break
            assert time.monotonic() < deadline, f"the {backend} server was not restarted"
            time.sleep(0.2)
        assert now.server_pid != spec.server_pid
        assert now.server_address == spec.server_address == pool.server_address
        _check_back(pool)
    finally:
        pool.shutdown()
