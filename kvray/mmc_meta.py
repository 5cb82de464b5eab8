"""Run MemCache's MetaService as a child process: the embedded default of the ``memcache``
backend when no ``meta_service_url`` is configured.

The service is ``memcache_hybrid.MetaService.main()`` in a child Python process, reading
an ``mmc-meta.conf`` that kvray writes (``MMC_META_CONFIG_PATH``) with its RPC, config
store and metrics listeners on free loopback ports and its logs in a fresh directory.
It is ready when ``GET <metrics_url>/health`` reports ``service_ready``. It dies with
its owner (``PR_SET_PDEATHSIG``) and :meth:`MetaService.stop` removes its directory and
the ``ptracer_<pid>.dat`` file memfabric writes under ``/var/log/memfabric_hybrid``.

MemCache allows one MetaService per host: it holds ``/tmp/mmc_meta_service.lock`` (path
fixed in the binary). A second one exits at once; kvray reports that with the fix.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvray.config import MemcacheMetaConfig, parse_host_port
from kvray.errors import BackendUnavailableError
from kvray.master import die_with_parent, free_port, terminate
from kvray.mmc_conf import render_conf

logger = logging.getLogger(__name__)

LOCK_FILE = "/tmp/mmc_meta_service.lock"
PTRACER_DIR = Path("/var/log/memfabric_hybrid")
_MAIN = (
    "import sys\n"
    "from memcache_hybrid import MetaService\n"
    "sys.exit(0 if MetaService.main() == 0 else 3)\n"
)


class MetaService:
    """One MemCache MetaService on loopback, with its own directory."""

    def __init__(self, config: MemcacheMetaConfig, *, host: str = "127.0.0.1", name: str = "kvray"):
        self.config = config
        self.host = host
        base = os.path.join(tempfile.gettempdir(), "kvray")
        os.makedirs(base, exist_ok=True)
        self.home = Path(tempfile.mkdtemp(prefix=f"mmc-{name}-", dir=base))
        self.meta_service_url = config.meta_service_url or ""
        self.config_store_url = config.config_store_url or ""
        self.metrics_url = config.metrics_url or ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _choose_ports(self) -> None:
        c = self.config
        self.meta_service_url = c.meta_service_url or f"tcp://{self.host}:{free_port(self.host)}"
        self.config_store_url = c.config_store_url or f"tcp://{self.host}:{free_port(self.host)}"
        self.metrics_url = c.metrics_url or f"http://{self.host}:{free_port(self.host)}"

    def conf(self) -> dict[str, str]:
        items = self.config.to_conf()
        items["ock.mmc.meta_service_url"] = self.meta_service_url
        items["ock.mmc.meta_service.config_store_url"] = self.config_store_url
        items["ock.mmc.meta_service.metrics_url"] = self.metrics_url
        items.setdefault("ock.mmc.log_path", str(self.home))
        return items

    def start(self, attempts: int = 3) -> str:
        """Start and wait for ``/health``; returns ``meta_service_url``."""
        for attempt in range(1, attempts + 1):
            self._choose_ports()
            if self._launch():
                return self.meta_service_url
            output = self.output()
            self._terminate()
            if "already running" in output or "lock file is locked" in output:
                self.stop()
                raise BackendUnavailableError(
                    "a MemCache MetaService already runs on this host (MemCache allows one per "
                    f"host: it holds {LOCK_FILE}): point memcache.meta_service_url and "
                    "config_store_url (mmc-local.conf, MMC_LOCAL_CONFIG_PATH) at it, or stop it"
                )
            logger.warning("MetaService attempt %d/%d did not come up", attempt, attempts)
        tail = self.output()[-3000:]
        self.stop()
        raise BackendUnavailableError(f"MemCache MetaService did not start:\n{tail}")

    def restart(self) -> str:
        """Start again after a crash or stop, on the same urls (clients reconnect)."""
        self._terminate()
        if not self._launch():
            raise BackendUnavailableError(
                f"MemCache MetaService did not restart:\n{self.output()[-3000:]}"
            )
        return self.meta_service_url

    def _launch(self) -> bool:
        """Write the conf, start the child, wait for ``/health``."""
        conf_path = self.home / "mmc-meta.conf"
        conf_path.write_text(render_conf(self.conf(), "written by kvray for its MetaService"))
        env = {**os.environ, "MMC_META_CONFIG_PATH": str(conf_path)}
        started = time.monotonic()
        with open(self.home / "stdout.log", "ab") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _MAIN],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent,
            )
        if not self._wait_ready():
            return False
        logger.info(
            "MemCache MetaService pid %d ready on %s in %.1f s (metrics %s)",
            self._proc.pid,
            self.meta_service_url,
            time.monotonic() - started,
            self.metrics_url,
        )
        return True

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

    def _wait_ready(self) -> bool:
        assert self._proc is not None, "MetaService._wait_ready before start"
        deadline = time.monotonic() + self.config.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            doc = self.health(timeout_s=0.5)
            if doc is not None and doc.get("service_ready") is True:
                return True
            time.sleep(0.1)
        return False

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _terminate(self, timeout_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # SIGTERM takes 3.5-5.5 s here; clients should be closed first (a request sent
        # during the shutdown waits 60 s in the client).
        terminate(proc, "MemCache MetaService", timeout_s)
        (PTRACER_DIR / f"ptracer_{proc.pid}.dat").unlink(missing_ok=True)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the service and remove its directory."""
        self._terminate(timeout_s)
        shutil.rmtree(self.home, ignore_errors=True)

    def output(self) -> str:
        parts = []
        for path in [self.home / "stdout.log", *sorted((self.home / "logs").glob("*.log"))]:
            try:
                parts.append(path.read_text(errors="replace"))
            except OSError:
                continue
        return "\n".join(parts)
