"""UCM's store config read as kvray settings (kvray.ucm): each key taken with its
meaning, refused naming kvray's equivalent, or listed as ignored."""

from __future__ import annotations

import pytest

from kvray.config import PoolConfig
from kvray.errors import ConfigError
from kvray.ucm import differences, settings

GiB = 1 << 30


def _ucm(**conf):  # type: ignore[no-untyped-def]
    return {"ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore",
                                "ucm_connector_config": conf}]}  # fmt: skip


def test_mooncake_posix_maps_to_kvrays_pipeline(tmp_path):
    got = settings(_ucm(
        store_pipeline="Mooncake|Posix", storage_backends=str(tmp_path), timeout_ms=30000,
        master_server_address="10.0.0.1:50088", protocol="Ascend", global_segment_size_gb=30,
        local_buffer_size_gb=1, replica_num=2, stream_number=8, io_direct=True,
        posix_io_engine="psync", posix_data_trans_concurrency=128, posix_capacity_gb=100,
        store_health={"enabled": True}, posix_gc_recycle_percent=0.1,
    ), {})  # fmt: skip
    assert got is not None
    assert got.pool == {
        "backend": "mooncake",
        "pipeline": "mooncake|ssd",
        "call_timeout_s": 30.0,
        "replica_num": 2,
        "io_threads": 8,
        "mooncake": {
            "master_server_address": "10.0.0.1:50088",
            "protocol": "Ascend",
            "global_segment_size": 30 * GiB,
            "local_buffer_size": GiB,
        },
        "ssd": {"path": str(tmp_path), "direct_io": True, "io_threads": 64, "quota": 100 * GiB},
    }
    assert got.ignored == [
        "posix_data_trans_concurrency above 64 (kvray uses 64)",
        "store_health",
        "posix_gc_recycle_percent",
    ]
    # what kvray builds from it validates (protocol in UCM's capitalisation included)
    cfg = PoolConfig.from_dict(got.pool)
    assert cfg.mooncake.protocol == "ascend" and cfg.ssd_tier
    assert differences(cfg, got.pool) == []
    other = PoolConfig.from_dict({"mooncake": {"global_segment_size": "1GB"}})
    diffs = differences(other, got.pool)
    assert "pipeline: pool None, UCM 'mooncake|ssd'" in diffs
    assert f"mooncake.global_segment_size: pool {GiB}, UCM {30 * GiB}" in diffs


def test_ucm_config_file_from_the_environment(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text(
        "use_layerwise: true\nenable_event_sync: true\nucm_connectors:\n"
        "  - ucm_connector_name: UcmPipelineStore\n    ucm_connector_config:\n"
        "      store_pipeline: YuanRong\n      yuanrong_host: 10.0.0.2\n"
        "      yuanrong_port: 18483\n      yuanrong_timeout_ms: 60000\n"
        "      yuanrong_load_worker_count: 4\n"
    )
    got = settings({}, {"UCM_CONFIG_FILE": str(path)})
    assert got is not None and got.source == f"UCM_CONFIG_FILE {path}"
    assert got.pool == {
        "backend": "yuanrong",
        "pipeline": "yuanrong",
        "yuanrong": {"worker_address": "10.0.0.2:18483", "request_timeout_ms": 60000},
    }
    assert got.connector == {"use_layerwise": True}
    assert set(got.ignored) == {"yuanrong_load_worker_count", "enable_event_sync"}
    assert settings({}, {}) is None


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        (
            {"store_pipeline": "Cache|Posix", "storage_backends": "/x"},
            "use store_pipeline 'Mooncake|Posix'",
        ),
        ({"store_pipeline": "Mooncake|Posix"}, "needs storage_backends"),
        (
            {"store_pipeline": "Mooncake|Posix", "storage_backends": "/a:/b"},
            "one directory per node",
        ),
        ({"store_pipeline": "Mooncake", "posix_io_engine": "aio"}, "set 'psync'"),
        ({"store_pipeline": "Mooncake", "global_segment_sise_gb": 4}, "a typo"),
        ({"store_pipeline": "YuanRong", "yuanrong_host": "h"}, "together"),
        ({}, "store_pipeline is required"),
    ],
)
def test_refusals_name_the_kvray_equivalent(conf, match):
    with pytest.raises(ConfigError, match=match):
        settings(_ucm(**conf), {})


def test_other_ucm_connectors_and_lite_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="UcmPipelineStore"):
        settings({"ucm_connectors": [{"ucm_connector_name": "UcmNfsStore"}]}, {})
    path = tmp_path / "lite.yaml"
    path.write_text(
        "use_lite: true\nucm_connectors:\n  - ucm_connector_name: UcmPipelineStore\n"
        "    ucm_connector_config: {store_pipeline: Mooncake}\n"
    )
    with pytest.raises(ConfigError, match="remove use_lite"):
        settings({"UCM_CONFIG_FILE": str(path)}, {})


def test_seed_mooncake_json_keys(tmp_path):
    """Keys Mooncake's own mooncake.json takes: tenant_id and the client HTTP server are
    kvray settings; ``enable_offload`` is the client offload; ``mode`` is accepted and
    ignored (Mooncake's client does not read it either)."""
    import json

    from kvray.config import MooncakeConfig

    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "master_server_address": "127.0.0.1:50088", "tenant_id": "team-a",
        "enable_client_http_server": True, "client_http_port": 19300, "mode": "standalone",
        "enable_offload": True, "ssd_offload_path": str(tmp_path),
    }))  # fmt: skip
    cfg = MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path)})
    assert (cfg.tenant_id, cfg.enable_client_http_server, cfg.client_http_port) == (
        "team-a",
        True,
        19300,
    )
    assert cfg.enable_ssd_offload and cfg.mode == "standalone"
    with pytest.raises(ValueError, match="one setting"):
        MooncakeConfig.model_validate({"enable_offload": True, "enable_ssd_offload": False})
