"""A server we start for a test or a benchmark: a vLLM OpenAI server, kvray's proxy, or
anything else that answers ``GET /health``, in its own process group with its log.

The one wrapper the e2e tests and the scripts (bench_serve, soak) share:

    server = Server("kvray", vllm_serve_cmd(model, port, "--kv-transfer-config", cfg),
                    env, tmp / "kvray.log", port=port)
    server.wait_healthy(time.monotonic() + 600)
    ...
    server.request_counts()  # the connector's per-request lines so far
    server.stop()

Its own process group lets a benchmark pause a whole server (SIGSTOP: an idle engine's
polling threads stop taking CPU from the one being measured) and lets ``stop`` reach the
engine processes the server started. A server that does not become healthy gets its
processes' Python stacks written into its log (``PYTHONFAULTHANDLER``, SIGABRT) before the
error, so a hang at startup shows where.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

import psutil

from kvray.connector.log_lines import RequestLine, key_space, request_lines
from kvray.keys import KeySpace


class ServerFailed(RuntimeError):
    """The server exited, or did not answer in time; the message ends with its log."""


def vllm_serve_cmd(
    model: str,
    port: int,
    *extra: str,
    max_model_len: int = 2048,
    prefix_caching: bool = False,
) -> list[str]:
    """vLLM's OpenAI server on ``127.0.0.1:port`` as kvray's tests and benchmarks run it:
    float32, eager, seed 0, vLLM's own prefix cache off unless ``prefix_caching``, then
    ``extra`` arguments."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--max-model-len", str(max_model_len), "--seed", "0",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        *extra,
    ]  # fmt: skip


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


class Server:
    """One process group we started (a command and what it runs), with its log."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], log: Path, *, port: int
    ) -> None:
        """``cmd`` serves on ``127.0.0.1:port``; its output goes to ``log``."""
        self.name, self.log, self.port = name, log, port
        self._out: IO[str] = open(log, "w")  # noqa: SIM115 (closed in stop)
        env = {**env, "PYTHONFAULTHANDLER": "1"}  # see dump_stacks
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, deadline: float, url: str | None = None) -> None:
        """Until ``url`` (default ``/health`` on its port) answers 200, by ``deadline``
        (``time.monotonic()``); :class:`ServerFailed` when the server exits first or the
        deadline passes (after writing its stacks into its log)."""
        url = url or self.url("/health")
        started = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(1)
        self.dump_stacks()
        waited = time.monotonic() - started
        raise ServerFailed(f"{self.name} not healthy after {waited:.0f} s:\n{self.tail(30000)}")

    def dump_stacks(self) -> None:
        """SIGABRT to every process of the server: with PYTHONFAULTHANDLER each writes its
        threads' Python stacks to the log as it dies (only for a server that is failing)."""
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == self.proc.pid]
        for p in group:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGABRT)
        psutil.wait_procs(group, timeout=5)

    def text(self) -> str:
        """Its whole log so far."""
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 6000) -> str:
        return self.text()[-n:]

    def request_lines(self) -> list[RequestLine]:
        """The connector's per-request lines so far (:mod:`kvray.connector.log_lines`)."""
        return request_lines(self.text())

    def request_counts(self) -> list[dict[str, int]]:
        return [line.counts for line in self.request_lines()]

    def wait_request_counts(self, n: int, timeout_s: float = 20.0) -> list[dict[str, int]]:
        """The per-request lines, once there are ``n`` (a request's line is logged as it
        finishes, which can trail its answer a little)."""
        deadline = time.monotonic() + timeout_s
        while len(counts := self.request_counts()) < n:
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"{self.name}: {len(counts)} request lines, wanted {n}:\n{self.tail()}"
                )
            time.sleep(0.2)
        return counts

    def key_space(self, timeout_s: float = 60.0) -> KeySpace:
        """The connector's keys as its scheduler logs them once the workers sent their
        block geometries (derived from the engine's KV caches, so read, not rebuilt)."""
        deadline = time.monotonic() + timeout_s
        while (space := key_space(self.text())) is None:
            if time.monotonic() > deadline:
                raise ServerFailed(f"{self.name} logged no key space in {timeout_s:g} s")
            time.sleep(0.5)
        return space

    def pause(self) -> None:
        """SIGSTOP to the whole server (its idle engine's polling threads stop taking the
        cores' time from a server measured or starting next to it)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the server alone, which stops its engine processes (SIGTERM to the
        whole group once left vLLM's psm_* queues behind); they get ``grace_s`` to exit by
        themselves (a SIGKILLed engine core leaves its shared memory behind), then
        whatever is left of the group gets SIGKILL."""
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == self.proc.pid]
        self.resume()  # a paused server cannot act on SIGTERM
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        psutil.wait_procs(group, timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._out.close()
