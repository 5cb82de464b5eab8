"""Mooncake's native SSD offload, configured as deployments do, against a real
mooncake_master started with --enable_offload by the pool (embedded mode)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvray import Pool
from kvray.config import PoolConfig
from kvray.errors import PoolFullError

pytestmark = pytest.mark.integration
MB = 1 << 20


@pytest.mark.timeout(170)
def test_blocks_evicted_from_dram_are_read_back_from_mooncake_ssd(ray_cluster, tmp_path):
    env = {
        # file per key writes promptly (the default bucket backend waits for a full bucket)
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend",
        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(1 << 30),
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(64 * MB),
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    }
    cfg = PoolConfig.from_dict(
        {
            "name": "mcoff",
            "namespace": "kvray-test",
            "world_size": 1,
            "detached": False,
            "cpus_per_rank": 0.2,
            "master": {"eviction_high_watermark_ratio": 0.7, "eviction_ratio": 0.5},
        },
        environ={
            **env,
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(32 * MB),
            "MOONCAKE_CONFIG_PATH": _mooncake_json(tmp_path),
        },
    )
    assert cfg.mooncake.enable_ssd_offload and cfg.mooncake.offload.env() == env
    values = np.random.default_rng(0).integers(0, 256, (64, MB), dtype=np.uint8)
    keys = [f"mcoff-{i}" for i in range(64)]
    with Pool.start(cfg) as pool:
        stored = []
        for k, v in zip(keys, values):  # 64 MB through a 32 MB segment
            for _ in range(30):
                try:
                    pool.put(k, v)
                    stored.append(k)
                    break
                except PoolFullError:
                    time.sleep(0.2)  # eviction (after offload) makes room
        assert len(stored) >= 60, f"only {len(stored)} of 64 puts landed"
        idx = [keys.index(k) for k in stored]
        # The segment holds at most 32 of them: the rest can only come from the SSD, once
        # Mooncake's offload (asynchronous) has written them: wait for that, not a time.
        deadline = time.monotonic() + 60
        while True:
            outs = pool.get(stored, out=[np.empty(MB, np.uint8) for _ in stored])
            if all(o is not None for o in outs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(o is not None and np.array_equal(o, values[i]) for o, i in zip(outs, idx))
        files = sum(len(f) for _, _, f in os.walk(tmp_path / "offload"))
        assert files >= len(stored) - 32, f"{files} offload files for {len(stored)} blocks"
        pool.shutdown()


def _mooncake_json(tmp_path) -> str:
    import json

    (tmp_path / "offload").mkdir()
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "protocol": "tcp",
                "local_buffer_size": "16MB",
                "enable_ssd_offload": True,
                "ssd_offload_path": str(tmp_path / "offload"),
            }
        )
    )
    return str(path)
