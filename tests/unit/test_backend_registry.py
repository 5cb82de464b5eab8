"""The backend registry (kvray.backends.registry): one row per backend, which every place
that needs a backend's server, addresses, environment or device setting asks, instead of
branching on the backend's name."""

from __future__ import annotations

from typing import get_args

import pytest

from kvray.backends.registry import SPECS, spec_of, with_client_settings
from kvray.config import POOL_CONFIGS, BackendName, PoolConfig
from kvray.engine_env import FORWARD_PREFIXES, NOT_FORWARDED
from kvray.errors import ConfigError
from kvray.servers.datasystem import DatasystemWorker
from kvray.servers.mmc_meta import MetaService
from kvray.servers.mooncake_master import MooncakeMaster
from kvray.status import PoolStatus


def test_every_backend_has_one_row_naming_real_config_sections():
    assert set(SPECS) == set(get_args(BackendName))
    fields = {f for model in POOL_CONFIGS.values() for f in model.model_fields}
    for name, spec in SPECS.items():
        assert spec.name == name
        assert spec.client_section in fields and set(spec.env_sections) <= fields
    with pytest.raises(AssertionError, match="kvray's bug"):
        spec_of("floppy")


@pytest.mark.parametrize(
    ("backend", "server", "cls", "external"),
    [
        ("mooncake", "mooncake_master", MooncakeMaster,
         {"mooncake": {"master_server_address": "10.0.0.1:50051"}}),
        ("yuanrong", "datasystem worker", DatasystemWorker,
         {"yuanrong": {"worker_address": "10.0.0.1:31501"}}),
        ("memcache", "MemCache MetaService", MetaService,
         {"memcache": {"meta_service_url": "tcp://10.0.0.1:5000",
                       "config_store_url": "tcp://10.0.0.1:6000"}}),
    ],
)  # fmt: skip
def test_embedded_or_external_server(backend, server, cls, external):
    spec = spec_of(backend)
    embedded = PoolConfig.from_dict({"backend": backend}, environ={})
    assert embedded.configured_server is None
    made = spec.make_server(embedded, "10.0.0.2")
    try:
        assert isinstance(made, cls) and made.what == server == spec.server_name
        # where server_host says; the datasystem worker serves its own node: loopback
        assert made.host == ("127.0.0.1" if backend == "yuanrong" else "10.0.0.2")
    finally:
        made.stop()  # removes the directory it made
    ext = PoolConfig.from_dict({"backend": backend, **external}, environ={})
    assert ext.configured_server is not None
    ((field, address),) = spec.reachability(ext)
    assert field.startswith(backend) and address.startswith("10.0.0.1:")
    status = PoolStatus("p", "kvray", backend, "x:1", True, 1)
    assert f"(embedded {server})" in status.table()


def test_embedded_master_offloads_with_the_clients():
    cfg = PoolConfig.from_dict(
        {"mooncake": {"enable_ssd_offload": True, "ssd_offload_path": "/tmp"}}, environ={}
    )
    master = spec_of("mooncake").make_server(cfg, "127.0.0.1")
    assert isinstance(master, MooncakeMaster) and master.config.enable_offload


def test_node_dependent_settings():
    mc = PoolConfig.from_dict({}, environ={})
    assert spec_of("mooncake").on_node(mc, "10.0.0.7").mooncake.local_hostname == "10.0.0.7"
    yr = PoolConfig.from_dict(
        {
            "backend": "yuanrong",
            "yuanrong": {
                "worker_address": "10.0.0.1:31501",
                "node_worker_addresses": {"10.0.0.2": "10.0.0.2:31501"},
            },
        },
        environ={},
    )
    spec = spec_of("yuanrong")
    assert spec.per_node_server(yr) and spec.node_local_fix
    assert spec.on_node(yr, "10.0.0.2").yuanrong.worker_address == "10.0.0.2:31501"
    with pytest.raises(ConfigError, match="no worker for node 10.0.0.9"):
        spec.on_node(yr, "10.0.0.9")


def test_what_the_embedded_server_chose_reaches_the_client_section():
    cfg = PoolConfig.from_dict({"backend": "memcache"}, environ={})
    got = with_client_settings(cfg, {"config_store_url": "tcp://127.0.0.1:6001"})
    assert got.memcache.config_store_url == "tcp://127.0.0.1:6001"
    assert with_client_settings(cfg, {}) is cfg


def test_device_memory_and_environment():
    npu = PoolConfig.from_dict({"backend": "yuanrong", "yuanrong": {"device": "npu"}}, environ={})
    device = spec_of("yuanrong").device_setting(npu)
    assert device is not None and (device.field, device.host_value) == ("yuanrong.device", "host")
    assert spec_of("mooncake").device_setting(PoolConfig.from_dict({}, environ={})) is None


def test_each_mooncake_client_of_a_node_gets_its_own_http_port():
    mc = {"enable_client_http_server": True, "client_http_port": 19300}
    cfg = PoolConfig.from_dict({"mooncake": mc}, environ={})
    ports = [spec_of("mooncake").for_rank(cfg, r).mooncake.client_http_port for r in (0, 3)]
    assert ports == [19300, 19303]
    plain = PoolConfig.from_dict({}, environ={})
    assert spec_of("mooncake").for_rank(plain, 3) is plain
    assert "MC_" in FORWARD_PREFIXES and "ASCEND_" in FORWARD_PREFIXES
    assert {"ASCEND_ENABLE_USE_FABRIC_MEM", "DS_WORKER_ADDR"} <= NOT_FORWARDED
