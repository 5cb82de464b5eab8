"""A ``memcache`` pool on this machine: the manager's embedded MetaService starts for
real; the rank's data client cannot (no Ascend driver), so the pool refuses to start with
that reason and leaves nothing behind. (A module of its own: MemCache allows one
MetaService per host, and test_memcache.py holds one for its module.)"""

from __future__ import annotations

import glob

import psutil
import pytest
import ray

from kvray import Pool
from kvray.config import PoolConfig
from kvray.errors import BackendUnavailableError
from kvray.naming import manager_name
from kvray.servers.mmc_meta import PTRACER_DIR

from .conftest import pool_actor_names

pytestmark = pytest.mark.integration


def config(name: str) -> PoolConfig:
    return PoolConfig.from_dict(
        {
            "name": name,
            "namespace": "kvray-test",
            "backend": "memcache",
            "detached": False,
            "cpus_per_rank": 0.2,
            "memcache": {"protocol": "host_tcp", "dram_size": "64MB"},
        },
        environ={},
    )


def test_embedded_meta_service_lifecycle_through_the_manager(ray_cluster):
    from kvray.actors.manager import PoolManagerActor

    cfg = config("mmcmgr")
    manager = (
        ray.remote(PoolManagerActor).options(namespace="kvray-test").remote(cfg.model_dump_json())
    )
    spec = ray.get(manager.spec.remote())
    assert spec.embedded and spec.server_alive
    assert spec.server_kind == "MemCache MetaService"
    assert spec.resolved["meta_service_url"] == spec.server_address
    assert spec.resolved["config_store_url"].startswith("tcp://127.0.0.1:")
    assert psutil.Process(spec.server_pid).is_running()
    assert len(glob.glob("/tmp/kvray/mmc-mmcmgr-*")) == 1, "the service's fresh directory"
    ray.get(manager.stop.remote())
    assert not psutil.pid_exists(spec.server_pid) or (
        psutil.Process(spec.server_pid).status() == psutil.STATUS_ZOMBIE
    )
    assert glob.glob("/tmp/kvray/mmc-mmcmgr-*") == []
    assert not (PTRACER_DIR / f"ptracer_{spec.server_pid}.dat").exists()
    ray.kill(manager)


@pytest.mark.skipif(
    bool(glob.glob("/dev/davinci[0-9]*")), reason="with an Ascend NPU the pool starts"
)
def test_pool_without_the_ascend_driver_is_refused_cleanly(ray_cluster):
    cfg = config("mmcpool")
    with pytest.raises(BackendUnavailableError, match="needs the Ascend driver"):
        Pool.start(cfg)
    with pytest.raises(ValueError):
        ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
    assert pool_actor_names(cfg) == []
    assert glob.glob("/tmp/kvray/mmc-mmcpool-*") == []
    # no client conf of a dead actor process is left either (a conf lives only through
    # its client's init; the teardown sweeps those of processes killed in one)
    for path in glob.glob("/tmp/kvray/mmc-local-*.conf"):
        pid = int(path.rsplit("-", 1)[1].removesuffix(".conf"))
        assert psutil.pid_exists(pid), f"{path} outlived its process"
