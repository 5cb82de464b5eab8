"""Backend servers that die and come back, with real servers: an
external ``mooncake_master`` and datasystem worker killed under a running pool, and the
pool's own embedded server killed. While a server is gone every call ends in a clear
error within the pool's timeouts (a lookup is a miss, by reason ``lookup_error``); once it
listens again on the same address the same pool serves again, with no restart of the pool
or its clients; blocks the dead server held are misses, never other bytes.

"Serves again" is waited for by asking the clients, never by the checks that follow: each
client's own health check (its backend reaches its server: no put, no get). Then each check
runs once, and a wrong byte fails the test at once.

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

from kvray import metrics
from kvray.errors import KVRayError
from kvray.keys import KeySpace, KVLayout, chain_block_hashes
from kvray.naming import manager_name

from .conftest import small_config

pytestmark = pytest.mark.integration

BACK_S = 60.0
"""How long a test waits for every client to reach the server again once it is back
(measured: Mooncake clients mount their segments on a restarted master within ~1 s; a
datasystem worker serves as soon as it listens)."""
HEALTH_TIMEOUT_S = 5.0
SPACE = KeySpace("recovery", KVLayout("float16", 16, 8, 128).tag())


def _block(v: int) -> np.ndarray:
    return np.full(8192, v, np.uint8)


def _round_trip(pool, key: str, v: int) -> None:  # type: ignore[no-untyped-def]
    """A put then a get of ``key``, once: any error or any wrong byte fails the test."""
    pool.put([key], [_block(v)])
    (got,) = pool.get([key], shape=(8192,), dtype=np.uint8)
    assert got is not None, f"{key}: stored, then missing"
    assert np.array_equal(got, _block(v)), f"{key}: wrong bytes {np.unique(got)[:8]}, not {v}"


def _healthy(client) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(client.health().result(HEALTH_TIMEOUT_S))
    except KVRayError:
        return False


def _wait_attached(pool, cfg, server_view=None) -> int:  # type: ignore[no-untyped-def]
    """Until every client of the pool says its backend reaches its server (the backend's
    own health check) and, given ``server_view`` (the server's own counters), the server
    counts every client's segment in its capacity; returns the asks it took. (A Mooncake
    client's health check passes as soon as the master answers, before the client has
    mounted its segment again; a put then is refused as pool_full.)"""
    manager = ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
    deadline = time.monotonic() + BACK_S
    asks = 0
    while True:
        asks += 1
        nodes = ray.get(manager.nodes.remote())
        attached = bool(nodes) and all(_healthy(a.client) for a in nodes)
        if attached and server_view is not None:
            segments = sum(r.segment_bytes for r in pool.stats().ranks)
            attached = server_view().get("master_total_capacity_bytes", 0) >= segments > 0
        if attached:
            return asks
        assert time.monotonic() < deadline, f"the clients are not attached {BACK_S} s after restart"
        time.sleep(0.2)


def _scraped(url: str):  # type: ignore[no-untyped-def]
    """The server's counters, read from its own metrics endpoint (empty while it does not
    answer)."""

    def view() -> dict[str, float]:
        try:
            return metrics.scrape(url)
        except OSError:
            return {}

    return view


def _metrics_url(pid: int) -> str:
    """A ``mooncake_master``'s own metrics endpoint, from its command line (the embedded
    one is the manager's child: the manager's last read of it may be the dead one's)."""
    import psutil

    args = dict(
        a.removeprefix("--").split("=", 1) for a in psutil.Process(pid).cmdline() if "=" in a
    )
    return f"http://{args['metrics_host']}:{args['metrics_port']}/metrics"


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


def _check_back(pool, cfg, server_view=None) -> None:  # type: ignore[no-untyped-def]
    _wait_attached(pool, cfg, server_view)
    (old,) = pool.get(["before"], shape=(8192,), dtype=np.uint8)
    assert old is None  # the dead server's blocks are misses, not other bytes
    _round_trip(pool, "after", 42)


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
            _round_trip(pool, "before", 1)
            master.kill()
            _check_down(pool, cfg)
            master.restart()  # what the operator (or a process supervisor) does
            _check_back(pool, cfg, _scraped(master.scrape_url()))
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
        _round_trip(pool, "before", 1)
        worker.kill()
        _check_down(pool, cfg)
        worker.restart()
        _check_back(pool, cfg)
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
        _round_trip(pool, "before", 1)
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
        view = _scraped(_metrics_url(now.server_pid)) if backend == "mooncake" else None
        _check_back(pool, cfg, view)
    finally:
        pool.shutdown()
