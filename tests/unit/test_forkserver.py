"""The engines' fork server (kvray/testing/forkserver.py) with a small module preloaded
in place of vLLM: each child is a process of its own with its own argv, environment,
working directory, streams, exit status and exit handlers; a signal reaches it and its
exit code says so; an environment that differs at import gets a server of its own; a
server whose driver goes away takes its children with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from kvray.testing import forkserver

PRELOAD = ("tests.fakes.fork_targets",)
TARGET = "tests.fakes.fork_targets"


@pytest.fixture(autouse=True)
def _servers_closed():
    yield
    forkserver.close_all(PRELOAD)  # this module's servers only: not the e2e engines'


def _spawn(tmp_path, func, *argv, env=None, stderr=None):  # type: ignore[no-untyped-def]
    log = stderr or (tmp_path / "child.log").open("w")
    return forkserver.spawn(
        f"{TARGET}:{func}", ["child", *argv], env or dict(os.environ), tmp_path, log,
        preload=PRELOAD,
    )  # fmt: skip


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is gone too
        return f.read().split(") ")[1].startswith("Z")


def test_child_has_its_own_argv_env_cwd_streams_and_exit_code(tmp_path, monkeypatch):
    env = {**os.environ, "ONLY_HERE": "yes", "RAY_ADDRESS": "127.0.0.1:1"}
    forkserver.server_for(env, tmp_path, PRELOAD)  # started here: it imports from the repo
    monkeypatch.chdir(tmp_path)
    with (tmp_path / "err.log").open("w") as err:
        proc = _spawn(tmp_path, "echo", "3", env=env, stderr=err)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("hello\n")
    got = json.loads(proc.stdout.readline())
    assert got == {"argv": ["child", "3"], "cwd": str(tmp_path), "pid": proc.pid,
                   "line": "hello", "only_here": "yes", "ray": "127.0.0.1:1"}  # fmt: skip
    assert proc.poll() is None
    proc.stdin.close()
    assert proc.wait(30) == 3 and proc.returncode == 3
    assert (tmp_path / "err.log").read_text() == "to stderr\n"
    assert proc.pid != os.getpid() and _gone(proc.pid)


def test_a_signal_reaches_the_child_and_its_exit_says_so(tmp_path):
    proc = _spawn(tmp_path, "sleep")
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    os.kill(proc.pid, signal.SIGSTOP)  # a paused child has not ended
    time.sleep(0.2)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGCONT)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_exit_handlers_run_when_the_child_ends(tmp_path):
    marker = tmp_path / "marker"
    proc = _spawn(tmp_path, "at_exit", str(marker))
    assert proc.wait(30) == 0
    assert marker.read_text() == "ran"


def test_only_an_environment_that_differs_at_import_gets_another_server(tmp_path):
    base = dict(os.environ)
    a = forkserver.server_for(base, tmp_path, PRELOAD)
    lazy = {**base, "RAY_ADDRESS": "127.0.0.1:2", "VLLM_CACHE_ROOT": str(tmp_path)}
    assert forkserver.server_for(lazy, tmp_path, PRELOAD) is a
    other = forkserver.server_for({**base, "PYTHONHASHSEED": "7"}, tmp_path, PRELOAD)
    assert other is not a and other.alive()
    assert "PYTHONHASHSEED" in other.log_path.read_text()  # why another server


def test_a_server_whose_driver_goes_away_takes_its_children(tmp_path):
    proc = _spawn(tmp_path, "sleep")
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    forkserver.close_all(PRELOAD)
    assert proc.wait(30) == -signal.SIGKILL
    assert _gone(proc.pid)
