"""An engine's native backend knobs (the seeds' launch-script exports) reach the pool's
actors it makes; a process whose knobs differ from the running actors' is told which."""

from __future__ import annotations

import logging

import pytest

from .conftest import small_config

pytestmark = pytest.mark.integration


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [p.split(b"=", 1) for p in f.read().split(b"\0") if b"=" in p]
    return {k.decode(): v.decode() for k, v in pairs}


def test_engine_env_reaches_the_actors_and_differences_are_reported(
    ray_cluster, mooncake_master, monkeypatch, caplog
):
    from kvray import Pool, launcher

    monkeypatch.setenv("HCCL_RDMA_TIMEOUT", "17")
    monkeypatch.setenv("ASCEND_CONNECT_TIMEOUT", "12345")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    cfg = small_config(mooncake_master.address)
    pool = Pool.start(cfg)
    try:
        handles = pool._h
        for actor in (handles.client(0), handles.client(1)):
            env = _environ(actor.probe().result(30)["pid"])
            assert (env.get("HCCL_RDMA_TIMEOUT"), env.get("ASCEND_CONNECT_TIMEOUT")) == (
                "17",
                "12345",
            )
            assert env.get("ASCEND_RT_VISIBLE_DEVICES") != "3", "device selection is not forwarded"

        monkeypatch.setenv("HCCL_RDMA_TIMEOUT", "20")
        monkeypatch.delenv("ASCEND_CONNECT_TIMEOUT")
        other = launcher.attach(cfg.name, cfg.namespace)  # another engine, other settings
        with caplog.at_level(logging.WARNING, logger="kvray.launcher"):
            assert other.client(0) is not None
        text = caplog.text
        assert "were started with other backend settings" in text, text
        assert "HCCL_RDMA_TIMEOUT: the pool's clients '17', this process '20'" in text
        assert "ASCEND_CONNECT_TIMEOUT: the pool's clients '12345', this process unset" in text
        env = _environ(other.client(0).probe().result(30)["pid"])
        assert env.get("HCCL_RDMA_TIMEOUT") == "17", "running actors keep their settings"
    finally:
        pool.shutdown()


def test_seed_mooncake_json_keys_reach_the_client(ray_cluster, mooncake_master):
    """tenant_id reaches Mooncake's client (which, in the Mooncake this runs, does not
    separate keys by it: measured here, and said in the docs); enable_client_http_server
    serves Mooncake's client HTTP endpoint on client_http_port + slot."""
    import socket
    import urllib.request

    import numpy as np

    from kvray import Pool

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    port = free_port()
    mc = {"tenant_id": "team-a", "enable_client_http_server": True, "client_http_port": port}
    a = Pool.start(small_config(mooncake_master.address, mooncake=mc, world_size=1))
    b = Pool.start(small_config(mooncake_master.address, world_size=1))  # tenant "default"
    try:
        a.put("tenant-key", np.ones(64, np.uint8))
        assert a.exists(["tenant-key"]) == [True]
        # Not separated by tenant (if a Mooncake release starts separating them, this
        # fails and the docs' note on tenant_id must change with it).
        assert b.exists(["tenant-key"]) == [True]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        a.shutdown()
        b.shutdown()
