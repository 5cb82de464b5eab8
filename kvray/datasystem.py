"""Run an openYuanrong ``datasystem_worker`` as a child process: the embedded default of
the ``yuanrong`` backend when no worker address is configured.

The worker runs the embedded metastore (no etcd) unless it is told to join another
worker's, listens on free loopback ports, keeps everything it writes (sockets, RocksDB,
logs, probe files) in a fresh directory that :meth:`DatasystemWorker.stop` removes, and
is started with ``PR_SET_PDEATHSIG`` so that it dies with the process that owns it. The
binary is started directly (what ``dscli start`` does after filling in its defaults), so
that its PID is ours to stop.

A stopped worker stays in the metastore's hash ring for ``node_dead_timeout_s``: a
restarted worker therefore reuses its directory and ports (:meth:`restart`), and a new
pool always gets a fresh metastore.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvray.config import DatasystemWorkerConfig
from kvray.errors import BackendUnavailableError, ConfigError
from kvray.master import crash, die_with_parent, free_port, terminate

logger = logging.getLogger(__name__)

# Small-footprint flags for a worker that serves one machine's ranks: the defaults start
# ~500 threads and a log monitor that uses 15-25 % of a core while idle.
_LEAN_FLAGS = {
    "enable_huge_tlb": "false",
    "enable_fallocate": "false",
    "log_monitor": "false",
    "sc_thread_num": "2",
    "master_sc_thread_num": "2",
    "sc_scan_thread_num": "1",
    "sc_local_cache_memory_size_mb": "16",
    "remote_send_thread_num": "2",
    "rocksdb_background_threads": "2",
    "rocksdb_write_mode": "none",
    "minloglevel": "1",
}


UDS_DIR_MAX = 80
"""Longest socket directory kept under the worker's home: Linux socket paths are at most
108 bytes and the worker appends ``/<8 hex>/<socket name>`` (up to ~25 bytes)."""


def datasystem_package_dir() -> Path:
    """Where ``openyuanrong-datasystem`` installed its binaries (no import: importing
    ``yr.datasystem`` loads native libraries this process may not want)."""
    import importlib.util

    spec = importlib.util.find_spec("yr.datasystem")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "backend 'yuanrong' without a worker address runs a datasystem worker, which "
            "needs openYuanrong datasystem: pip install 'kvray[yuanrong]', or set "
            "yuanrong.worker_address / DS_WORKER_ADDR to a running worker"
        )
    return Path(next(iter(spec.submodule_search_locations)))


class DatasystemWorker:
    """One ``datasystem_worker`` on loopback, with its own directory."""

    def __init__(
        self,
        config: DatasystemWorkerConfig,
        *,
        metastore_address: str | None = None,
        host: str = "127.0.0.1",
        name: str = "kvray",
    ) -> None:
        self.config = config
        self.host = host
        self.joins = metastore_address
        """The metastore of another worker to join (None: run the embedded one)."""
        self.port = 0
        self.metastore_port = 0
        base = config.data_dir or os.path.join(tempfile.gettempdir(), "kvray")
        os.makedirs(base, exist_ok=True)
        self.home = Path(tempfile.mkdtemp(prefix=f"ds-{name}-", dir=base))
        self.uds_dir = self.home / "uds"
        if len(str(self.uds_dir)) > UDS_DIR_MAX:
            # The worker's sockets live at <dir>/<8 hex>/<name>: a long data_dir would pass
            # the 108-byte limit of a socket path and the worker would refuse to start.
            self.uds_dir = Path(tempfile.mkdtemp(prefix="kvray-uds-", dir="/tmp"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metastore_address(self) -> str:
        return self.joins or f"{self.host}:{self.metastore_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    def command(self) -> list[str]:
        pkg = datasystem_package_dir()
        h = self.home
        flags = {
            "worker_address": self.address,
            "metastore_address": self.metastore_address,
            "start_metastore_service": "false" if self.joins else "true",
            "shared_memory_size_mb": str(self.config.shared_memory_size >> 20),
            "oc_thread_num": str(self.config.threads),
            "rpc_thread_num": str(self.config.threads),
            "unix_domain_socket_dir": str(self.uds_dir),
            "rocksdb_store_dir": str(h / "rocksdb"),
            "log_dir": str(self.log_dir),
            "ready_check_path": str(h / "probe" / "ready"),
            "health_check_path": str(h / "probe" / "healthy"),
            "monitor_config_file": str(h / "config" / "datasystem.config"),
            **_LEAN_FLAGS,
        }
        return [
            str(pkg / "datasystem_worker"),
            *(f"--{k}={v}" for k, v in flags.items()),
            *self.config.extra_args,
        ]

    def start(self, attempts: int = 3) -> str:
        """Start and wait for the worker's ready file; retry on a port race."""
        for attempt in range(1, attempts + 1):
            if not self.port:
                self.port = free_port(self.host)
                self.metastore_port = 0 if self.joins else free_port(self.host)
            if self._launch_and_wait():
                return self.address
            self._terminate()
            logger.warning("datasystem worker attempt %d/%d did not come up", attempt, attempts)
            self.port = 0
        tail = self.log_tail()
        self._remove_home()
        raise BackendUnavailableError(
            f"datasystem worker did not start after {attempts} attempts; last log lines:\n{tail}"
        )

    def restart(self) -> str:
        """Start again after a crash or stop, on the same address and directory."""
        self._terminate()
        if not self._launch_and_wait():
            raise BackendUnavailableError(
                f"datasystem worker did not restart on {self.address}:\n{self.log_tail()}"
            )
        return self.address

    def _launch_and_wait(self) -> bool:
        ready = self.home / "probe" / "ready"
        ready.unlink(missing_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pkg = datasystem_package_dir()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{pkg / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
        started = time.monotonic()
        with open(self.log_dir / "stdout.log", "ab") as out:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent,
            )
        deadline = started + self.config.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if ready.exists() and self._accepts():
                logger.info(
                    "datasystem worker pid %d ready on %s in %.1f s (metastore %s)",
                    self._proc.pid,
                    self.address,
                    time.monotonic() - started,
                    self.metastore_address,
                )
                return True
            time.sleep(0.1)
        return False

    def _accepts(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests); :meth:`restart` brings it back."""
        crash(self._proc)

    def _terminate(self, timeout_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        terminate(proc, "datasystem worker", timeout_s)

    def _remove_home(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        shutil.rmtree(self.uds_dir, ignore_errors=True)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the worker (SIGTERM, as ``dscli stop`` does) and remove its directory."""
        self._terminate(timeout_s)
        self._remove_home()

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")) if self.log_dir.is_dir() else []:
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out) or "<no log>"
