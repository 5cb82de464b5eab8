"""The embedded default with real Ray and a real Mooncake master: engine processes with no
Ray cluster configured start one node-local pool (its keeper: a local Ray on loopback and
the pool), later ones join it and see the same blocks, and the keeper stops Ray and the
pool once the last of them is gone, killed ones included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvray.embedded import Files, read_state

ENGINE = r"""
import json, sys
import numpy as np
from kvray.embedded import connect
from kvray import Pool
import ray
data = (np.arange(4096) % 251).astype(np.uint8)
overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
how = connect(None, "kvray-emb", "emb", sys.argv[1] or None, 1, overrides)
pool = Pool.attach("emb", "kvray-emb")
out = {"how": how, "address": ray.get_runtime_context().gcs_address,
       "config": json.loads(pool.config.model_dump_json())}
if sys.argv[2] == "put":
    pool.put("blk", data)
else:
    got = pool.get("blk", shape=(4096,), dtype=np.uint8)
    out["same"] = got is not None and bool((got == data).all())
pool.close()
print(json.dumps(out), flush=True)
sys.stdin.readline()  # stay an engine of the pool until told to go
"""


def _engine(
    env: dict[str, str], config: Path | None, op: str, *more: str
) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(config or ""), op, *more],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        pytest.fail(f"engine {op} failed:\n{proc.stderr.read()[-4000:] if proc.stderr else ''}")
    return proc, json.loads(line)


def _wait(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}")


def test_engines_share_the_embedded_pool_and_the_last_one_stops_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(KVRAY_RUN_DIR=str(tmp_path / "run"), KVRAY_EMBEDDED_LINGER_S="1")
    config = tmp_path / "pool.json"
    config.write_text(
        json.dumps({"mooncake": {"global_segment_size": "64MB", "local_buffer_size": "16MB"}})
    )
    first, a = _engine(env, config, "put")
    second = None
    try:
        assert a["how"].startswith("embedded pool")
        files = Files(Path(env["KVRAY_RUN_DIR"]) / "kvray-emb.emb")
        state = read_state(files)
        assert state is not None and state["address"] == a["address"]
        keeper = psutil.Process(state["pid"])
        assert keeper.pid != first.pid
        assert "Started" in files.log.read_text() or "is up" in files.log.read_text()

        second, b = _engine(env, config, "get")
        assert b["address"] == a["address"], "the second engine started another cluster"
        assert b["same"], "the second engine does not see the first one's block"
        assert read_state(files)["pid"] == keeper.pid  # type: ignore[index]

        first.communicate("\n", timeout=60)  # the first engine leaves
        time.sleep(4)  # > linger: the keeper stays for the second
        assert keeper.is_running(), f"keeper stopped with an engine left:\n{files.log.read_text()}"

        second.send_signal(signal.SIGKILL)  # a crashed engine counts as gone too
        second.wait(30)
        _wait(lambda: not keeper.is_running(), 90, "the keeper stops after the last engine")
        assert not files.state.exists()
        log = files.log.read_text()
        assert "no engine uses the pool any more" in log and "stopped" in log, log[-3000:]
        # Nothing of its Ray cluster is left: the GCS port no longer answers.
        from kvray.servers.process import why_unreachable

        assert why_unreachable(a["address"], 1.0) is not None
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
        s = read_state(Files(tmp_path / "run" / "kvray-emb.emb"))
        if s is not None:  # a failed test must not leave the keeper running
            os.kill(s["pid"], signal.SIGTERM)
            _wait(lambda: read_state(Files(tmp_path / "run" / "kvray-emb.emb")) is None, 60,
                  "keeper stops on SIGTERM")  # fmt: skip


def test_keeper_that_cannot_start_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAY_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    bad = tmp_path / "pool.json"
    bad.write_text(json.dumps({"mooncake": {"global_segment_size": "lots"}}))
    from kvray.embedded import join
    from kvray.errors import EmbeddedPoolError

    t0 = time.monotonic()
    with pytest.raises(EmbeddedPoolError) as err:
        join("kvray-emb", "bad", str(bad), 1, timeout_s=120)
    assert time.monotonic() - t0 < 60
    assert "did not start" in str(err.value) and "global_segment_size" in str(err.value)


def test_ucm_store_settings_make_the_embedded_pool(tmp_path):
    """A UCM deployment's store config (``ucm_connectors``, UcmPipelineStore
    ``Mooncake|Posix``) is what the embedded pool an engine starts is made of: Mooncake
    DRAM in front of kvray's SSD tier in ``storage_backends``, with UCM's segment size,
    replicas, streams and timeout; a block stored goes to both tiers."""
    from kvray import ucm

    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()
    settings = ucm.settings(
        {"ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": {
            "store_pipeline": "Mooncake|Posix", "storage_backends": str(ssd_dir),
            "global_segment_size_gb": 1, "local_buffer_size_gb": 1, "replica_num": 1,
            "stream_number": 2, "timeout_ms": 20000, "io_direct": False, "protocol": "tcp",
            "posix_capacity_gb": 2, "cache_buffer_capacity_gb": 32}}]},
        {},
    )  # fmt: skip
    assert settings is not None and settings.ignored == ["cache_buffer_capacity_gb"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(KVRAY_RUN_DIR=str(tmp_path / "run"), KVRAY_EMBEDDED_LINGER_S="1")
    proc, out = None, {}
    try:
        proc, out = _engine(env, None, "put", json.dumps(settings.pool))
        cfg = out["config"]
        assert out["how"].startswith("embedded pool")
        assert (cfg["backend"], cfg["pipeline"]) == ("mooncake", "mooncake|ssd")
        assert cfg["ssd"]["path"] == str(ssd_dir) and cfg["ssd"]["quota"] == 2 << 30
        assert cfg["ssd"]["direct_io"] is False
        assert cfg["mooncake"]["global_segment_size"] == 1 << 30
        assert (cfg["io_threads"], cfg["call_timeout_s"]) == (2, 20.0)
        stored = list(ssd_dir.rglob("*"))
        assert any(p.is_file() for p in stored), f"nothing on the SSD tier: {stored}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.communicate("\n", timeout=60)
        files = Files(tmp_path / "run" / "kvray-emb.emb")
        _wait(lambda: read_state(files) is None, 90, "the keeper stops after the engine")
