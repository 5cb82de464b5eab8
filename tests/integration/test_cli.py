"""`kvray up | status | down` as a user runs them against an existing Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def kvray(gcs_address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "32MB"}
    env.pop("MOONCAKE_CONFIG_PATH", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvray.cli",
            "--address",
            gcs_address,
            "--namespace",
            "kvray-cli",
            "--name",
            "clitest",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_up_status_down(ray_cluster, tmp_path):
    try:
        up = kvray(ray_cluster, "up", "--world-size", "2")
        assert up.returncode == 0, up.stderr
        assert "kvray pool 'clitest' is up" in up.stdout and "embedded mooncake_master" in up.stdout
        again = kvray(ray_cluster, "up", "--world-size", "2")  # idempotent
        assert again.returncode == 0, again.stderr
        status = kvray(ray_cluster, "status")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0].startswith("kvray pool 'clitest'") and "2 client(s) per node" in lines[0]
        rows = [line.split() for line in lines[2:5]]
        assert lines[5].startswith("memory (master): ") and "used of 64.0 MiB" in lines[5], lines
        assert [r[0] for r in rows] == ["127.0.0.1/" + rows[0][0].split("/")[1]] * 2 + ["total"]
        assert [r[1] for r in rows[:2]] == ["0", "1"]
        js = json.loads(kvray(ray_cluster, "status", "--json").stdout)
        assert js["world_size"] == 2 and js["embedded"] and all(r["alive"] for r in js["ranks"])
        assert js["ranks"][0]["segment_bytes"] == 32 << 20
    finally:
        down = kvray(ray_cluster, "down")
    assert down.returncode == 0, down.stderr
    gone = kvray(ray_cluster, "status")
    assert gone.returncode == 2 and "no kvray pool 'clitest'" in gone.stderr


def test_bad_config_is_reported_by_field(ray_cluster, tmp_path):
    cfg = tmp_path / "pool.yaml"
    cfg.write_text("name: clitest2\nworld_size: 0\n")
    res = kvray(ray_cluster, "up", "--config", str(cfg))
    assert res.returncode == 2
    assert "world_size" in res.stderr and "greater than or equal to 1" in res.stderr
