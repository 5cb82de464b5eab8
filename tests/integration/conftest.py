"""Real backend servers for the integration tests (the Ray cluster is in tests/conftest.py):
one ``mooncake_master`` and two openYuanrong datasystem workers (the second joins the
first one's embedded metastore) per test session, started on first use and stopped at
the end; every pool a test starts is stopped by the test (or its fixture) and checked to
leave nothing behind.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import psutil
import pytest

_names = itertools.count()


@pytest.fixture(scope="session")
def mooncake_master():
    """A real mooncake_master on free loopback ports, with a short read lease."""
    from kvray.config import MooncakeMasterConfig
    from kvray.servers.mooncake_master import MooncakeMaster

    with tempfile.TemporaryDirectory(prefix="kvray-test-master-") as log_dir:
        config = MooncakeMasterConfig(default_kv_lease_ttl_ms=200, client_ttl_s=2)
        master = MooncakeMaster(config, log_dir)
        master.start()
        yield master
        master.stop()
        assert not master.alive()


def _datasystem_worker(**kw):
    from kvray.config import DatasystemWorkerConfig
    from kvray.servers.datasystem import DatasystemWorker

    worker = DatasystemWorker(DatasystemWorkerConfig(shared_memory_size="256MB", threads=2), **kw)
    worker.start()
    return worker


def stop_and_check(worker) -> None:
    """Stop a datasystem worker; assert its process and directory are gone."""
    pid = worker.pid
    worker.stop()
    assert not worker.alive()
    assert (
        pid is None
        or not psutil.pid_exists(pid)
        or (psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    )
    assert not worker.home.exists(), f"{worker.home} left behind"


@pytest.fixture(scope="session")
def ds_worker():
    """A real datasystem worker with its embedded metastore, on free loopback ports."""
    worker = _datasystem_worker(name="test-a")
    yield worker
    stop_and_check(worker)


@pytest.fixture(scope="session")
def ds_worker2(ds_worker):
    """A second worker on the first one's metastore (another node's worker, in effect)."""
    worker = _datasystem_worker(name="test-b", metastore_address=ds_worker.metastore_address)
    yield worker
    stop_and_check(worker)


def pool_name(prefix: str = "t") -> str:
    """A pool name of this test worker alone: each xdist worker has its own Ray cluster,
    but they share a kernel, and checks of what a pool left behind (its regions in
    ``/proc/*/maps``) go by the pool's name (two workers' ``t8`` once failed one)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return f"{prefix}{worker}-{next(_names)}" if worker else f"{prefix}{next(_names)}"


def small_config(master_address: str | None, **overrides):
    """A small 2-rank pool config; ``backend="yuanrong"`` gives one with an embedded
    datasystem worker (``master_address`` is then ignored)."""
    from kvray.config import PoolConfig

    data: dict = {
        "name": pool_name(),
        "namespace": "kvray-test",
        "world_size": 2,
        "detached": False,
        "cpus_per_rank": 0.2,
        "transfer_window_size": "8MB",
        "mooncake": {
            "master_server_address": master_address,
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
            "protocol": "tcp",
        },
        "master": {"default_kv_lease_ttl_ms": 200, "client_ttl_s": 2},
    }
    if overrides.get("backend") == "yuanrong":
        del data["mooncake"], data["master"]
        data["yuanrong"] = {"request_timeout_ms": 3000, "connect_timeout_ms": 3000}
        data["datasystem"] = {"shared_memory_size": "256MB", "threads": 2}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return PoolConfig.from_dict(data, environ={})


def users_lease() -> dict[str, int]:
    """A ``master`` section with the users' default read lease, for a test of an embedded
    Mooncake master that reads blocks back and is not about leases: the suite's 200 ms can
    run out while a get on a loaded machine copies (seen across clients, and in a full
    pool), and Mooncake then fails the read (LEASE_EXPIRED: transfer_failed, never the
    bytes)."""
    from kvray.config import MooncakeMasterConfig

    return {"default_kv_lease_ttl_ms": MooncakeMasterConfig().default_kv_lease_ttl_ms}


def ssd_pool_config(tmp_path, name: str, **over):  # type: ignore[no-untyped-def]
    """A 1-rank pool of a 16 MB Mooncake DRAM tier over a 256 MB SSD tier in ``tmp_path``
    (``over``: other fields; a dict is merged into the section)."""
    ssd = {"path": str(tmp_path), "quota": "256MB", "io_threads": 2, **over.pop("ssd", {})}
    return small_config(
        None,
        name=name,
        world_size=1,
        pipeline="mooncake|ssd",
        ssd=ssd,
        mooncake={"global_segment_size": "16MB"},
        **over,
    )


@pytest.fixture(scope="module", params=["mooncake", "yuanrong"])
def pool(request, ray_cluster):
    """A 2-rank pool shared by a module's tests, once per backend: against the session's
    mooncake_master, and with its own embedded datasystem worker."""
    from kvray import Pool

    if request.param == "mooncake":
        cfg = small_config(request.getfixturevalue("mooncake_master").address)
    else:
        cfg = small_config(None, backend="yuanrong")
    p = Pool.start(cfg)
    yield p
    p.shutdown()


def pool_actor_names(cfg) -> list[str]:  # type: ignore[no-untyped-def]
    """The live named actors of pool ``cfg`` (manager, node clients, lookups, SSD)."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == cfg.namespace and a["name"].startswith(f"{cfg.name}.")
    )
