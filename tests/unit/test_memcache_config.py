"""MemCache configuration as deployments write it: mmc-local.conf / mmc-meta.conf through
MMC_LOCAL_CONFIG_PATH / MMC_META_CONFIG_PATH, typed and validated; the return-code map."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvray.backends.base import KeyStatus
from kvray.backends.memcache import UNAVAILABLE, status_of
from kvray.config import MemcacheConfig, MemcacheMetaConfig, PoolConfig
from kvray.config.mmc_conf import KNOWN_KEYS, parse_conf, render_conf
from kvray.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def shipped(name: str) -> Path:
    spec = importlib.util.find_spec("memcache_hybrid")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("memcache-hybrid is not installed (pip install 'kvray[memcache]')")
    return Path(next(iter(spec.submodule_search_locations))) / "config" / name


@pytest.mark.parametrize("name", ["mmc-local.conf", "mmc-meta.conf"])
def test_the_templates_memcache_ships_parse(name):
    items = parse_conf(shipped(name).read_text(), source=name)
    assert items["ock.mmc.meta_service_url"] == "tcp://127.0.0.1:5000"


def test_local_conf_from_the_environment():
    path = shipped("mmc-local.conf")
    cfg = MemcacheConfig.from_env({"MMC_LOCAL_CONFIG_PATH": str(path)})
    assert cfg.meta_service_url == "tcp://127.0.0.1:5000"
    assert cfg.config_store_url == "tcp://127.0.0.1:6000"
    assert cfg.protocol == "host_rdma" and cfg.world_size == 256 and cfg.dram_size == 1 << 30
    # ... and written back as MemCache reads it
    again = parse_conf(render_conf(cfg.to_conf(), "x"), source="rendered")
    assert again["ock.mmc.local_service.dram.size"] == str(1 << 30)


def test_kvray_example_configs_are_valid():
    local = MemcacheConfig.from_env({"MMC_LOCAL_CONFIG_PATH": str(REPO / "configs/mmc-local.conf")})
    meta = MemcacheMetaConfig.from_env(
        {"MMC_META_CONFIG_PATH": str(REPO / "configs/mmc-meta.conf")}
    )
    assert local.config_store_url == meta.config_store_url


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ock.mmc.local_service.protcol = host_tcp", r"x.conf:1: unknown MemCache key"),
        ("# c\nock.mmc.log_level", r"x.conf:2: expected 'key = value'"),
        ("ock.mmc.log_level = info\nock.mmc.log_level = warn", "set twice"),
        ("ock.mmc.local_service.protocol = tcp", r"protocol: Input should be 'device_rdma'"),
        ("ock.mmc.meta_service_url = 127.0.0.1:5000", r"meta_service_url: expected tcp://"),
        ("ock.mmc.meta_service_url = tcp://h:0", r"meta_service_url: .*1\.\.65535"),
        ("ock.mmc.local_service.dram.size = 2TB", r"dram_size: MemCache accepts at most 1TB"),
        ("ock.mmc.local_service.dram.size = 1.2.3GB", r"dram_size: .*cannot parse size"),
        ("ock.mmc.local_service.world_size = 0", r"world_size: Input should be greater"),
        (
            "ock.mmc.local_service.dram.size = 0\nock.mmc.local_service.hbm.size = 0",
            "cannot both be 0",
        ),
        ("ock.mmc.meta_service_url = tcp://10.0.0.1:5000", "config_store_url is required"),
    ],
)
def test_bad_local_conf_names_the_file_line_or_field(tmp_path, text, match):
    path = tmp_path / "x.conf"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        MemcacheConfig.from_env({"MMC_LOCAL_CONFIG_PATH": str(path)})


def test_memcache_size_spellings(tmp_path):
    path = tmp_path / "l.conf"
    for text, size in [
        ("2048K", 2 << 20),
        ("200m", 200 << 20),
        ("2.5GB", 5 << 29),
        ("134217728", 1 << 27),
    ]:
        path.write_text(f"ock.mmc.local_service.dram.size = {text}")
        assert MemcacheConfig.from_env({"MMC_LOCAL_CONFIG_PATH": str(path)}).dram_size == size


def test_missing_file_and_meta_thresholds(tmp_path):
    with pytest.raises(ConfigError, match="MMC_LOCAL_CONFIG_PATH: cannot read"):
        MemcacheConfig.from_env({"MMC_LOCAL_CONFIG_PATH": str(tmp_path / "nope.conf")})
    path = tmp_path / "m.conf"
    path.write_text("ock.mmc.evict_threshold_high = 70\nock.mmc.evict_threshold_low = 80")
    with pytest.raises(ConfigError, match="evict_threshold_low .80. must be below"):
        MemcacheMetaConfig.from_env({"MMC_META_CONFIG_PATH": str(path)})
    path.write_text("ock.mmc.meta_service.metrics_url = tcp://127.0.0.1:8000")
    with pytest.raises(ConfigError, match="metrics_url: expected http://"):
        MemcacheMetaConfig.from_env({"MMC_META_CONFIG_PATH": str(path)})


def test_pool_config_reads_mmc_files_and_checks_world_size(tmp_path):
    path = tmp_path / "l.conf"
    path.write_text("ock.mmc.local_service.world_size = 2\nock.mmc.client.timeout.seconds = 3")
    env = {"MMC_LOCAL_CONFIG_PATH": str(path)}
    cfg = PoolConfig.from_dict({"backend": "memcache", "world_size": 2}, environ=env)
    assert cfg.embedded_server and cfg.memcache.extra == {"ock.mmc.client.timeout.seconds": "3"}
    with pytest.raises(ConfigError, match="world_size 4 exceeds memcache.world_size 2"):
        PoolConfig.from_dict({"backend": "memcache", "world_size": 4}, environ=env)
    with pytest.raises(ValueError, match="is a typed field here: set 'protocol'"):
        MemcacheConfig(extra={"ock.mmc.local_service.protocol": "host_tcp"})


@pytest.mark.parametrize("name", ["mmc-local.conf", "mmc-meta.conf"])
def test_known_keys_cover_the_templates_commented_keys_too(name):
    import re

    keys = re.findall(r"^#?\s*((?:ock\.mmc|ubsio)\.[\w.]+)\s*=", shipped(name).read_text(), re.M)
    assert keys and set(keys) <= KNOWN_KEYS


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (0, KeyStatus.OK),
        (-3102, KeyStatus.NOT_FOUND),
        (-3007, KeyStatus.NOT_FOUND),
        (-3016, KeyStatus.POOL_FULL),
        (-3104, KeyStatus.BUSY),
        (-3106, KeyStatus.TRANSFER_FAILED),
        (-3000, KeyStatus.INVALID),
        (-1, KeyStatus.ERROR),
    ],
)
def test_return_codes(code, status):
    assert status_of(code) is status


def test_unavailable_codes_are_the_connection_ones():
    assert {-3004, -3014, -3019} <= UNAVAILABLE and -3102 not in UNAVAILABLE
