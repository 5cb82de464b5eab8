"""What of an engine's environment reaches the pool's actors, and how a pool configured
otherwise is reported (kvray.engine_env)."""

from __future__ import annotations

import json

from kvray.config import PoolConfig
from kvray.engine_env import config_differences, env_differences, forwarded


def test_native_knobs_are_forwarded_but_not_device_selection():
    env = {
        "ASCEND_CONNECT_TIMEOUT": "10000",
        "ASCEND_TRANSFER_TIMEOUT": "10000",
        "HCCL_RDMA_TIMEOUT": "17",
        "HCCL_INTRA_ROCE_ENABLE": "1",
        "MC_TE_METRIC": "1",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/mnt/ssd",
        "ASCEND_RT_VISIBLE_DEVICES": "0,1",
        "ASCEND_ENABLE_USE_FABRIC_MEM": "1",
        "PATH": "/usr/bin",
        "PYTHONHASHSEED": "0",
    }
    assert forwarded(env) == {
        k: env[k]
        for k in (
            "ASCEND_CONNECT_TIMEOUT",
            "ASCEND_TRANSFER_TIMEOUT",
            "HCCL_RDMA_TIMEOUT",
            "HCCL_INTRA_ROCE_ENABLE",
            "MC_TE_METRIC",
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
        )
    }
    assert env_differences({"A_X": "1"}, {"A_X": "1"}) == []
    assert env_differences(
        {"HCCL_RDMA_TIMEOUT": "17"}, {"HCCL_RDMA_TIMEOUT": "20", "MC_X": "1"}
    ) == [
        "HCCL_RDMA_TIMEOUT: the pool's clients '17', this process '20'",
        "MC_X: the pool's clients unset, this process '1'",
    ]


def test_a_pool_configured_otherwise_than_the_engines_environment_is_named(tmp_path):
    pool = PoolConfig.from_dict({"mooncake": {"global_segment_size": "1GB", "protocol": "tcp"}})
    assert config_differences(pool, {}) == []  # the engine sets nothing: nothing to compare
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"global_segment_size": "2GB", "protocol": "tcp"}))
    diffs = config_differences(pool, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert diffs == [
        f"mooncake.global_segment_size: pool {1 << 30}, this process's environment "
        f"{2 << 30} (from MOONCAKE_CONFIG_PATH)"
    ]
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"global_segment_size": "1GB", "protocol": "tcp"}))
    assert config_differences(pool, {"MOONCAKE_CONFIG_PATH": str(same)}) == []
    bad = config_differences(pool, {"MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"})
    assert len(bad) == 1 and "does not make a valid config" in bad[0]

    ds = PoolConfig.from_dict({"backend": "yuanrong", "yuanrong": {}})
    (diff,) = config_differences(ds, {"DS_WORKER_ADDR": "127.0.0.1:31501"})
    assert diff.startswith("yuanrong.worker_address: pool None") and "127.0.0.1:31501" in diff
