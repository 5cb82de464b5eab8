"""How an engine process chooses its Ray cluster (kvray.embedded.connect), without Ray:
a configured address that does not answer, ``auto`` with nothing running and a stale
``ray start`` record all fail or fall through within seconds, never after Ray's minutes of
retries; a busy start lock is an error naming the log."""

from __future__ import annotations

import fcntl
import socket
import time

import pytest

from kvray import embedded
from kvray.errors import ConfigError, EmbeddedPoolError


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _no_ray_init(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("connect() must not reach ray.init here")

    monkeypatch.setattr("kvray.ray_env.ray_init", refuse)


@pytest.mark.parametrize("source", ["RAY_ADDRESS", "ray_address"])
def test_configured_cluster_that_does_not_answer_is_an_error_within_seconds(monkeypatch, source):
    address = f"127.0.0.1:{closed_port()}"
    if source == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
        field = None
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        field = address
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        embedded.connect(field, "kvray", "kvray", None, 1)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert address in msg and f"({source})" in msg and "does not answer" in msg
    assert "ray start --head" in msg and "kvray up" in msg


def test_auto_with_no_cluster_on_the_node_is_an_error(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(embedded, "_local_cluster", lambda any_gcs=False: None)
    with pytest.raises(ConfigError, match=r"RAY_ADDRESS is 'auto' but no Ray cluster answers"):
        embedded.connect(None, "kvray", "kvray", None, 1)


def test_a_stale_ray_start_record_is_ignored(monkeypatch):
    stale = f"127.0.0.1:{closed_port()}"
    monkeypatch.setattr("ray._private.utils.read_ray_address", lambda temp_dir=None: stale)
    t0 = time.monotonic()
    assert embedded._local_cluster() is None
    assert time.monotonic() - t0 < 5


def test_a_live_ray_start_record_is_used(monkeypatch):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        live = f"127.0.0.1:{srv.getsockname()[1]}"
        monkeypatch.setattr("ray._private.utils.read_ray_address", lambda temp_dir=None: live)
        assert embedded._local_cluster() == live


def test_busy_start_lock_is_an_error_naming_the_log(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRAY_RUN_DIR", str(tmp_path))
    files = embedded.Files.of("ns", "p")
    with files.start_lock.open("a+") as other:  # another engine mid-start
        fcntl.flock(other, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with pytest.raises(EmbeddedPoolError) as err:
            embedded.join("ns", "p", None, 1, timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    assert str(files.log) in str(err.value) and "kvray up" in str(err.value)


def test_state_of_a_dead_keeper_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRAY_RUN_DIR", str(tmp_path))
    files = embedded.Files.of("ns", "p")
    files.state.write_text('{"pid": 999999999, "address": "127.0.0.1:1"}')
    assert embedded.read_state(files) is None
    files.state.write_text("not json")
    assert embedded.read_state(files) is None


def test_a_recorded_cluster_on_another_host_is_not_this_nodes():
    """Ray's record of the last cluster (/tmp/ray/ray_current_cluster) counts only when its
    host is an address of this machine: a record of another host's (or a network
    namespace's) cluster is ignored even where something accepts the connection."""
    from kvray.embedded import _on_this_node

    assert _on_this_node("127.0.0.1:6379")
    assert not _on_this_node("10.77.0.1:6379")  # the multi-node harness's node A
    assert not _on_this_node("192.0.2.7:6379")  # TEST-NET-1: no host's address
