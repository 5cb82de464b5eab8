"""Run MemCache's MetaService as a child process: the embedded default of the ``memcache``
backend when no ``meta_service_url`` is configured.

The service is ``memcache_hybrid.MetaService.main()`` in a child Python process, reading
an ``mmc-meta.conf`` that kvray writes (``MMC_META_CONFIG_PATH``) with its RPC, config
store and metrics listeners on free loopback ports and its logs in a fresh directory.
It is ready when ``GET <metrics_url>/health`` reports ``service_ready``.
:meth:`MetaService.stop` removes its directory and the ``ptracer_<pid>.dat`` file
memfabric writes under ``/var/log/memfabric_hybrid``.

MemCache allows one MetaService per host: it holds ``/tmp/mmc_meta_service.lock`` (path
fixed in the binary). A second one exits at once; kvray reports that with the fix.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
from pathlib import Path

from kvray.config import MemcacheMetaConfig, parse_host_port
from kvray.config.mmc_conf import render_conf
from kvray.servers.process import ServerProcess, free_port

LOCK_FILE = "/tmp/mmc_meta_service.lock"
PTRACER_DIR = Path("/var/log/memfabric_hybrid")
_MAIN = (
    "import sys\n"
    "from memcache_hybrid import MetaService\n"
    "sys.exit(0 if MetaService.main() == 0 else 3)\n"
)


class MetaService(ServerProcess):
    """One MemCache MetaService on loopback, with its own directory."""

    what = "MemCache MetaService"
    stop_timeout_s = 15.0
    """SIGTERM takes 3.5-5.5 s here; clients should be closed first (a request sent during
    the shutdown waits 60 s in the client)."""

    def __init__(
        self, config: MemcacheMetaConfig, *, host: str = "127.0.0.1", name: str = "kvray"
    ) -> None:
        super().__init__(host)
        self.config = config
        base = os.path.join(tempfile.gettempdir(), "kvray")
        os.makedirs(base, exist_ok=True)
        self.home = Path(tempfile.mkdtemp(prefix=f"mmc-{name}-", dir=base))
        self.meta_service_url = config.meta_service_url or ""
        self.config_store_url = config.config_store_url or ""
        self.metrics_url = config.metrics_url or ""

    @property
    def address(self) -> str:
        return self.meta_service_url

    @property
    def _conf_path(self) -> Path:
        return self.home / "mmc-meta.conf"

    def conf(self) -> dict[str, str]:
        items = self.config.to_conf()
        items["ock.mmc.meta_service_url"] = self.meta_service_url
        items["ock.mmc.meta_service.config_store_url"] = self.config_store_url
        items["ock.mmc.meta_service.metrics_url"] = self.metrics_url
        items.setdefault("ock.mmc.log_path", str(self.home))
        return items

    def command(self) -> list[str]:
        return [sys.executable, "-c", _MAIN]

    def client_settings(self) -> dict[str, str]:
        # Clients need the config store as well as the service's url.
        return {
            "meta_service_url": self.meta_service_url,
            "config_store_url": self.config_store_url,
        }

    def health(self, timeout_s: float = 1.0) -> dict[str, object] | None:
        """The ``/health`` document, or None when it does not answer."""
        # http.client, not urllib: MemCache's HTTP server never answers a request that
        # carries urllib's "Connection: close" (measured: curl and http.client work).
        host, port = parse_host_port(self.metrics_url.split("://", 1)[1], field="metrics_url")
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        try:
            conn.request("GET", "/health")
            doc: dict[str, object] = json.loads(conn.getresponse().read())
            return doc
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def output(self) -> str:
        """Everything the service wrote (its stdout and its log files)."""
        parts = []
        for path in self.log_files():
            try:
                parts.append(path.read_text(errors="replace"))
            except OSError:
                continue
        return "\n".join(parts)

    def log_files(self) -> list[Path]:
        return [self._stdout_path, *sorted((self.home / "logs").glob("*.log"))]

    @property
    def _stdout_path(self) -> Path:
        return self.home / "stdout.log"

    def _choose_ports(self) -> None:
        c = self.config
        self.meta_service_url = c.meta_service_url or f"tcp://{self.host}:{free_port(self.host)}"
        self.config_store_url = c.config_store_url or f"tcp://{self.host}:{free_port(self.host)}"
        self.metrics_url = c.metrics_url or f"http://{self.host}:{free_port(self.host)}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "MMC_META_CONFIG_PATH": str(self._conf_path)}

    def _prepare(self) -> None:
        super()._prepare()
        self._conf_path.write_text(render_conf(self.conf(), "written by kvray for its MetaService"))

    def _ready(self) -> bool:
        doc = self.health(timeout_s=0.5)
        return doc is not None and doc.get("service_ready") is True

    def _ready_timeout_s(self) -> float:
        return self.config.ready_timeout_s

    def _ready_details(self) -> str:
        return f" (metrics {self.metrics_url})"

    def _refusal(self) -> str | None:
        output = self.output()
        if "already running" in output or "lock file is locked" in output:
            return (
                "a MemCache MetaService already runs on this host (MemCache allows one per "
                f"host: it holds {LOCK_FILE}): point memcache.meta_service_url and "
                "config_store_url (mmc-local.conf, MMC_LOCAL_CONFIG_PATH) at it, or stop it"
            )
        return None

    def _leftovers(self, pid: int) -> list[Path]:
        return [PTRACER_DIR / f"ptracer_{pid}.dat"]

    def _own_dirs(self) -> list[Path]:
        return [self.home]
