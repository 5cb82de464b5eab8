"""Run an openYuanrong ``datasystem_worker`` as a child process: the embedded default of
the ``yuanrong`` backend when no worker address is configured.

The worker runs the embedded metastore (no etcd) unless it is told to join another
worker's, listens on free loopback ports, and keeps everything it writes (sockets, RocksDB,
logs, probe files) in a fresh directory that :meth:`DatasystemWorker.stop` removes. The
binary is started directly (what ``dscli start`` does after filling in its defaults), so
that its PID is ours to stop. It is ready when it has written its ready file and its
port accepts.

A stopped worker stays in the metastore's hash ring for ``node_dead_timeout_s``: a
restarted worker therefore reuses its directory and ports (:meth:`restart`), and a new
pool always gets a fresh metastore.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvray.config import DatasystemWorkerConfig
from kvray.errors import ConfigError
from kvray.servers.process import ServerProcess, free_port

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


class DatasystemWorker(ServerProcess):
    """One ``datasystem_worker`` on loopback, with its own directory."""

    what = "datasystem worker"

    def __init__(
        self,
        config: DatasystemWorkerConfig,
        *,
        metastore_address: str | None = None,
        host: str = "127.0.0.1",
        name: str = "kvray",
    ) -> None:
        super().__init__(host)
        self.config = config
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

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metastore_address(self) -> str:
        return self.joins or f"{self.host}:{self.metastore_port}"

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
            "ready_check_path": str(self._ready_file),
            "health_check_path": str(h / "probe" / "healthy"),
            "monitor_config_file": str(h / "config" / "datasystem.config"),
            **_LEAN_FLAGS,
        }
        return [
            str(pkg / "datasystem_worker"),
            *(f"--{k}={v}" for k, v in flags.items()),
            *self.config.extra_args,
        ]

    def log_files(self) -> list[Path]:
        return sorted(self.log_dir.glob("*.log")) if self.log_dir.is_dir() else []

    @property
    def _ready_file(self) -> Path:
        return self.home / "probe" / "ready"

    @property
    def _stdout_path(self) -> Path:
        return self.log_dir / "stdout.log"

    def _choose_ports(self) -> None:
        self.port = free_port(self.host)
        self.metastore_port = 0 if self.joins else free_port(self.host)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        lib = datasystem_package_dir() / "lib"
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
        return env

    def _prepare(self) -> None:
        self._ready_file.unlink(missing_ok=True)
        super()._prepare()

    def _ready(self) -> bool:
        return self._ready_file.exists() and self._accepts(self.port, 0.5)

    def _ready_timeout_s(self) -> float:
        return self.config.ready_timeout_s

    def _ready_details(self) -> str:
        return f" (metastore {self.metastore_address})"

    def _own_dirs(self) -> list[Path]:
        return [self.home, self.uds_dir]
