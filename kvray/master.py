"""Run ``mooncake_master`` as a child process: the embedded default when no master
address is configured.

The master listens on free loopback ports (RPC and metrics; two masters never collide
on the default metrics port 9003). It is started with ``PR_SET_PDEATHSIG`` so that it
dies with the process that owns it, even when that process is killed: no orphans.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvray.config import MooncakeMasterConfig
from kvray.errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """Runs in a child between fork and exec: SIGTERM it when its parent thread dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate(proc: subprocess.Popen[bytes] | None, what: str, timeout_s: float) -> None:
    """SIGTERM a child we started, wait, and SIGKILL it if it ignores that."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("%s pid %d ignored SIGTERM; killing it", what, proc.pid)
        proc.kill()
        proc.wait()


def crash(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL a child we started, as a crash would (tests), and reap it."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def why_unreachable(address: str, timeout_s: float = 3.0) -> str | None:
    """None when ``address`` (``host:port``) accepts a connection, else why not."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except ValueError:
        return f"{address!r} is not host:port"
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def check_reachable(host: str, port: int, timeout_s: float, error: str) -> None:
    """Connect once; on failure raise BackendUnavailableError(``error``: reason)."""
    why = why_unreachable(f"{host}:{port}", timeout_s)
    if why is not None:
        raise BackendUnavailableError(error.format(reason=why))


def find_master_binary() -> str:
    """``mooncake_master`` next to the running interpreter (a venv), else on PATH."""
    candidate = Path(sys.executable).parent / "mooncake_master"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mooncake_master")
    if found is None:
        raise ConfigError(
            "mooncake_master is not installed: pip install 'kvray[cpu]' (or [cuda]/[npu]), "
            "or set mooncake.master_server_address / MOONCAKE_MASTER to a running master"
        )
    return found


class MooncakeMaster:
    """One ``mooncake_master`` child process on loopback."""

    def __init__(
        self,
        config: MooncakeMasterConfig,
        log_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.host = host
        self.log_path = Path(log_dir) / f"mooncake_master-{os.getpid()}.log"
        self.rpc_port = 0
        self.metrics_port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        c = self.config
        return [
            find_master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--eviction_high_watermark_ratio={c.eviction_high_watermark_ratio}",
            f"--eviction_ratio={c.eviction_ratio}",
            f"--default_kv_lease_ttl={c.default_kv_lease_ttl_ms}",
            f"--client_ttl={c.client_ttl_s}",
            *(["--enable_offload=true"] if c.enable_offload else []),
            *c.extra_args,
        ]

    def start(self, timeout_s: float = 15.0, attempts: int = 3) -> str:
        """Start and wait until the RPC port accepts; retry on a port race."""
        for attempt in range(1, attempts + 1):
            self.rpc_port, self.metrics_port = free_port(self.host), free_port(self.host)
            self._launch()
            if self._wait_ready(timeout_s):
                logger.info("mooncake_master pid %d listening on %s", self.pid, self.address)
                return self.address
            self.stop()
            logger.warning("mooncake_master attempt %d/%d did not come up", attempt, attempts)
        raise BackendUnavailableError(
            f"mooncake_master did not start after {attempts} attempts; last lines of "
            f"{self.log_path}:\n{self._log_tail()}"
        )

    def restart(self, timeout_s: float = 15.0) -> str:
        """Start again after a crash or stop, on the same ports: the clients find it there
        and mount their segments again (what it held is gone)."""
        self.stop()
        self._launch()
        if not self._wait_ready(timeout_s):
            self.stop()
            raise BackendUnavailableError(
                f"mooncake_master did not restart on {self.address}; last lines of "
                f"{self.log_path}:\n{self._log_tail()}"
            )
        logger.info("mooncake_master pid %d listening again on %s", self.pid, self.address)
        return self.address

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests); :meth:`restart` brings it back."""
        crash(self._proc)

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )

    def _wait_ready(self, timeout_s: float) -> bool:
        assert self._proc is not None, "MooncakeMaster._wait_ready before start"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                socket.create_connection((self.host, self.rpc_port), timeout=0.2).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        terminate(proc, "mooncake_master", timeout_s)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"
