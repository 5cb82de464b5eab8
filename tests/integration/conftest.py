"""One real ``mooncake_master`` per test session (the Ray cluster is in tests/conftest.py).

Both are started here and stopped at the end; every pool a test starts is stopped by
the test (or its fixture) and checked to leave nothing behind.
"""

from __future__ import annotations

import itertools
import tempfile

import pytest

_names = itertools.count()


@pytest.fixture(scope="session")
def mooncake_master():
    """A real mooncake_master on free loopback ports, with a short read lease."""
    from kvray.config import MooncakeMasterConfig
    from kvray.master import MooncakeMaster

    with tempfile.TemporaryDirectory(prefix="kvray-test-master-") as log_dir:
        config = MooncakeMasterConfig(default_kv_lease_ttl_ms=200, client_ttl_s=2)
        master = MooncakeMaster(config, log_dir)
        master.start()
        yield master
        master.stop()
        assert not master.alive()


def pool_name(prefix: str = "t") -> str:
    return f"{prefix}{next(_names)}"


def small_config(master_address: str | None, **overrides):
    from kvray.config import PoolConfig

    data = {
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
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return PoolConfig.from_dict(data, environ={})


@pytest.fixture(scope="module")
def pool(ray_cluster, mooncake_master):
    """A 2-rank pool against the session's master, shared by a module's tests."""
    from kvray import Pool

    p = Pool.start(small_config(mooncake_master.address))
    yield p
    p.shutdown()
