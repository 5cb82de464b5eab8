"""One lifecycle for the backends' servers that kvray runs as child processes.

A :class:`ServerProcess` picks free loopback ports, starts its command with its output in
a log file, waits until the server is ready, and retries with fresh ports when it does
not come up (another process took a port between the pick and the bind). A port that
accepts counts only when the child itself listens there: another process that took the
port would otherwise pass for the server until it goes away. A started
server can be killed as a crash would (tests), restarted on the same ports (its clients
reconnect there by themselves), and stopped (SIGTERM, then SIGKILL if ignored). Children
are started with ``PR_SET_PDEATHSIG``: they die with the process that owns them, even
when that one is killed, so none is orphaned.

A subclass says only what differs: the command line and its environment, the ports, one
readiness probe, the log files, and what to remove when it stops.

The helpers here (free ports, reachability, terminating a child) are shared by the
backend clients and the CLI too.
"""

from __future__ import annotations

import abc
import ctypes
import ipaddress
import logging
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

from kvray.errors import BackendUnavailableError

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


def is_loopback(address: str) -> bool:
    """Whether a server address (``host:port``, ``tcp://host:port``, ``[v6]:port``)
    names a loopback host: on another node it would be that node itself."""
    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reachable(host: str, port: int, timeout_s: float, error: str) -> None:
    """Connect once; on failure raise BackendUnavailableError(``error``: reason)."""
    why = why_unreachable(f"{host}:{port}", timeout_s)
    if why is not None:
        raise BackendUnavailableError(error.format(reason=why))


def accepts(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepts a connection now."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, inode in column 9
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself holds a socket listening on TCP ``port``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            link = fd.readlink()
        except OSError:
            continue
        if str(link).startswith("socket:[") and str(link)[8:-1] in inodes:
            return True
    return False


class ServerProcess(abc.ABC):
    """One backend server as a child process on ``host``."""

    what: ClassVar[str]
    """The server as logs and errors name it (``mooncake_master``)."""
    stop_timeout_s: ClassVar[float] = 15.0
    """How long :meth:`stop` waits after SIGTERM before SIGKILL."""
    poll_s: ClassVar[float] = 0.1
    """Pause between readiness probes."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- what differs ------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where clients connect (what :meth:`start` returns)."""

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The command line, for the ports chosen last."""

    @abc.abstractmethod
    def _choose_ports(self) -> None:
        """Pick the ports of the next start attempt."""

    @abc.abstractmethod
    def _ready(self) -> bool:
        """One readiness probe of the running child (:meth:`_accepts` for a port)."""

    @abc.abstractmethod
    def _ready_timeout_s(self) -> float:
        """How long one start attempt waits for :meth:`_ready`."""

    @property
    @abc.abstractmethod
    def _stdout_path(self) -> Path:
        """Where the child's stdout and stderr go (appended)."""

    def log_files(self) -> list[Path]:
        """The files :meth:`log_tail` shows."""
        return [self._stdout_path]

    def _env(self) -> dict[str, str] | None:
        """The child's environment (None: this process's)."""
        return None

    def _prepare(self) -> None:
        """Before each launch: make what the child needs on disk."""
        self._stdout_path.parent.mkdir(parents=True, exist_ok=True)

    def _refusal(self) -> str | None:
        """After a failed attempt: why retrying cannot help (raised as the error)."""
        return None

    def _leftovers(self, pid: int) -> list[Path]:
        """Files the child ``pid`` leaves outside its directories (removed once it is
        stopped)."""
        return []

    def _own_dirs(self) -> list[Path]:
        """The server's own directories (removed by :meth:`stop`)."""
        return []

    def _ready_details(self) -> str:
        """Appended to the log line that says the server is ready."""
        return ""

    def client_settings(self) -> dict[str, Any]:
        """Fields of the backend's client section that this server chose at start and its
        clients need besides :attr:`address` (MemCache: the config store's url)."""
        return {}

    def scrape_url(self) -> str | None:
        """Prometheus endpoint with the server's own counters (kvray.metrics.SERVER_KEYS),
        or None."""
        return None

    # ---- the shared lifecycle ------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _accepts(self, port: int, timeout_s: float) -> bool:
        """The child listens on ``port`` and it accepts a connection."""
        proc = self._proc
        return proc is not None and listens(proc.pid, port) and accepts(self.host, port, timeout_s)

    def start(self, timeout_s: float | None = None, attempts: int = 3) -> str:
        """Start and wait until ready (``timeout_s`` per attempt; None: the server's own);
        retry on fresh ports when it does not come up. Returns :attr:`address`."""
        for attempt in range(1, attempts + 1):
            self._choose_ports()
            if self._launch_and_wait(timeout_s):
                return self.address
            refusal = self._refusal()
            self._terminate()
            if refusal is not None:
                self.stop()
                raise BackendUnavailableError(refusal)
            logger.warning("%s attempt %d/%d did not come up", self.what, attempt, attempts)
        tail = self.log_tail()
        self.stop()
        raise BackendUnavailableError(
            f"{self.what} did not start after {attempts} attempts; last log lines:\n{tail}"
        )

    def restart(self, timeout_s: float | None = None) -> str:
        """Start again after a crash or stop, on the same ports and files: the clients
        find it there (what it held in memory is gone)."""
        self._terminate()
        if not self._launch_and_wait(timeout_s):
            tail = self.log_tail()
            self._terminate()
            raise BackendUnavailableError(
                f"{self.what} did not restart on {self.address}; last log lines:\n{tail}"
            )
        return self.address

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests); :meth:`restart` brings it back."""
        crash(self._proc)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the child (SIGTERM, then SIGKILL) and remove the server's files."""
        self._terminate(timeout_s)
        for path in self._own_dirs():
            shutil.rmtree(path, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for path in self.log_files():
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(out) or "<no log>"

    def _launch_and_wait(self, timeout_s: float | None) -> bool:
        self._prepare()
        started = time.monotonic()
        with open(self._stdout_path, "ab") as out:
            self._proc = proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                preexec_fn=die_with_parent,
            )
        deadline = started + (self._ready_timeout_s() if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if self._ready():
                logger.info(
                    "%s pid %d ready on %s in %.1f s%s",
                    self.what,
                    proc.pid,
                    self.address,
                    time.monotonic() - started,
                    self._ready_details(),
                )
                return True
            time.sleep(self.poll_s)
        return False

    def _terminate(self, timeout_s: float | None = None) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        terminate(proc, self.what, self.stop_timeout_s if timeout_s is None else timeout_s)
        for path in self._leftovers(proc.pid):
            path.unlink(missing_ok=True)
