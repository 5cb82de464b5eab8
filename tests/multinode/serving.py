"""vLLM OpenAI servers on the harness's nodes, for the multinode tests: start them, wait
for the API's health, post completions to it (from node A: it listens on A's loopback)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PORT = 18000
STARTUP_S = 480
"""A server per node starts in minutes on a loaded 2-core host."""


def post(two_nodes: Any, body: dict[str, Any], *, port: int = PORT, dp_rank: int | None = None,
         timeout: float = 300) -> dict[str, Any]:  # fmt: skip
    """A completion sent on node A to the API on its loopback; ``dp_rank``: to that DP
    rank (vLLM's ``X-data-parallel-rank``)."""
    headers = {"Content-Type": "application/json"}
    if dp_rank is not None:
        headers["X-data-parallel-rank"] = str(dp_rank)
    code = (
        "import json, sys, urllib.request\n"
        f"r = urllib.request.Request('http://127.0.0.1:{port}/v1/completions', "
        f"data=sys.stdin.buffer.read(), headers={headers!r})\n"
        f"print(urllib.request.urlopen(r, timeout={timeout}).read().decode())\n"
    )
    n = two_nodes.nodes["A"]
    res = subprocess.run(
        n.argv(sys.executable, "-c", code), input=json.dumps(body), text=True,
        capture_output=True, timeout=timeout + 20, env=two_nodes.env(n),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(json.loads(res.stdout))


def wait_healthy(two_nodes: Any, procs: list[tuple[subprocess.Popen[bytes], Path]],
                 port: int = PORT) -> None:  # fmt: skip
    """Until the API on node A answers ``/health``; fails when a server exits first."""
    health = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health')"
    deadline = time.monotonic() + STARTUP_S
    while two_nodes.run_python("A", health, check=False, timeout=30).returncode != 0:
        for proc, log in procs:
            assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, [log.read_text()[-3000:] for _, log in procs]
        time.sleep(2)


def stop(procs: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    """SIGTERM each server's process group (each started in a session of its own: a
    shell and what it started, vLLM's API servers, engine cores and workers), then
    SIGKILL what is left of it."""
    for proc, _ in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    for proc, _ in procs:
        # (poll reaps the leader: a zombie would keep its group "alive")
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def serving(
    two_nodes: Any,
    tmp_path: Path,
    pool: str,
    servers: list[tuple[str, str, list[str]]],
    env: dict[str, str],
) -> Iterator[Path]:
    """Start ``servers`` ((log name, node, python argv); the first serves the API on node
    A, on :data:`PORT`), wait for its health; yields the first server's log; stops them
    all and the pool."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for name, node, argv in servers:
            if name == servers[0][0]:
                argv = [*argv, "--host", "127.0.0.1", "--port", str(PORT)]
            n = two_nodes.nodes[node]
            log = tmp_path / f"{name}.log"
            with open(log, "w") as out:
                procs.append((subprocess.Popen(
                    n.argv(sys.executable, *argv), env=two_nodes.env(n, **env),
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                ), log))  # fmt: skip
        wait_healthy(two_nodes, procs)
        yield procs[0][1]
    finally:
        stop(procs)
        two_nodes.run("A", "down", pool, check=False)
