"""`ray job submit` of scripts/pool_job.py against a head node with a dashboard.

The head is its own `ray start --head --block` process (stopped by PID: SIGTERM makes it
stop the Ray processes it started), separate from the session's in-process cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kvray.servers.process import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def head_with_dashboard(tmp_path):
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}  # jobs run our python
    gcs, dash = free_port(), free_port()
    # Its own temp dir (short: Ray's socket paths have a length limit), so the
    # ray_current_cluster file it writes never redirects another test's ray.init().
    temp_dir = tempfile.mkdtemp(prefix="kvray-ray-")
    log = (tmp_path / "head.log").open("wb")  # noqa: SIM115  (outlives this statement)
    proc = subprocess.Popen(
        [
            f"{bindir}/ray",
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            # Fixed defaults (agent 52365, ...) collide with the session's own cluster.
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(
                    f"ray head did not come up: {(tmp_path / 'head.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
    yield url, env
    proc.terminate()
    proc.wait(timeout=60)
    log.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.timeout(300)
def test_pool_job_under_ray_job_submit(head_with_dashboard):
    url, env = head_with_dashboard
    cmd = [
        str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", url,
        "--working-dir", str(ROOT), "--",
        "python", "scripts/pool_job.py", "--name", "jobtest", "--start", "--down",
        "--requests", "4", "--blocks", "8",
    ]  # fmt: skip
    deadline = time.monotonic() + 90
    while True:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        # The dashboard answers before the node's job agent registers with it.
        if "No available agent" not in res.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "started pool 'jobtest'" in out
    assert "request 1: 8 blocks, 4 from the pool, 4 stored" in out
    assert "pool 'jobtest' stopped" in out and "succeeded" in out
