"""A fork server for the test engines: a process that imports vLLM once, then forks a
process of its own for each engine the tests start.

Importing vLLM (with torch, transformers and Ray) takes ~11 s of an engine's ~15 s start
on a 2-core machine; a process forked after the import starts the same engine in ~4 s.
What the child runs is unchanged: its own process (PID, signals, exit status), its own
environment, standard streams and working directory, its own Ray connection, model, KV
cache and connector. What differs from a fresh interpreter is only what the import did:
state taken from the environment *at import* (Python's hash seed, thread and allocator
settings, vLLM's logging setup and platform plugins, Ray's constants). So a child runs
only in a server whose environment equals its own but for :data:`LAZY_ENV`, variables
read when an engine starts, not at import; other environments get a server of their own.

The server stays single-threaded (it forks). Protocol, over a ``SOCK_SEQPACKET`` Unix
socket, one connection per child: the driver sends a JSON header (``target``
``"module:function"``, ``argv``, ``env``, ``cwd``) with the child's stdin, stdout and
stderr as file descriptors; the server answers ``{"pid": N}``, and ``{"returncode": N}``
when the child has exited (negative: killed by that signal). A server whose driver went
away (its stdin closed) SIGKILLs the children it still has and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

LAZY_ENV = frozenset({
    "RAY_ADDRESS", "VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_OMP_THREADS_BIND", "PYTEST_CURRENT_TEST",
})  # fmt: skip
"""Variables that may differ between a server and its children: each is read when an
engine starts (Ray's address at ``ray.init``; vLLM's by ``vllm.envs`` on access, the
thread binding when the CPU worker or the multiprocessing executor starts), or by nothing
in an engine (pytest's name of the running test)."""

PRELOAD = (
    "torch",
    "vllm",
    "vllm.inputs",
    "vllm.model_executor.models.llama",
    "vllm.v1.worker.cpu_worker",
    "kvray.connector.connector",
    "kvray.testing.engine",
)
"""What the server imports before it forks (the test engines' model and CPU worker
included)."""

MAX_SERVERS = 2
"""Servers alive at once (~0.7 GiB each); the least recently used is closed first."""

START_TIMEOUT_S = 300.0


def import_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a server's children must share with it."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in LAZY_ENV))


class ForkedProcess:
    """A child of a fork server, with the part of ``subprocess.Popen``'s interface the
    engine driver uses (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``kill``,
    ``terminate``, ``send_signal``)."""

    def __init__(
        self, conn: socket.socket, pid: int, stdin: IO[str] | None, stdout: IO[str] | None
    ) -> None:
        self._conn = conn
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _read_exit(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self._conn.settimeout(timeout)
            try:
                msg = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            except OSError:
                msg = b""
            # The server closed the connection without a status: it was killed, and the
            # child with it (it SIGKILLs its children when its driver goes away).
            self.returncode = json.loads(msg)["returncode"] if msg else -signal.SIGKILL
            self._conn.close()

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One server process (driver side)."""

    def __init__(
        self, env: Mapping[str, str], log_dir: Path, preload: Sequence[str] = PRELOAD
    ) -> None:
        self.env = dict(env)
        self._children: list[ForkedProcess] = []
        self._dir = Path(tempfile.mkdtemp(prefix="kvray-fork-", dir=log_dir))
        # The socket in a directory of the system's temp dir: a Unix socket's path is at
        # most 107 bytes, a test's directory can be longer.
        self._socket_dir = tempfile.mkdtemp(prefix="kvray-fork-")
        self.socket_path = os.path.join(self._socket_dir, "sock")
        self.log_path = self._dir / "server.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, self.socket_path, *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        out = self.proc.stdout.fileno()
        seen = b""
        while b"ready\n" not in seen:
            left = deadline - time.monotonic()
            readable = left > 0 and select.select([out], [], [], min(left, 1.0))[0]
            chunk = os.read(out, 4096) if readable else b""
            if (readable and not chunk) or left <= 0:
                self.close()
                raise RuntimeError(
                    "the engines' fork server did not start; its log ends:\n"
                    f"{self.log_path.read_text(errors='replace')[-4000:]}"
                )
            seen += chunk

    def spawn(
        self,
        target: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdin: int,
        stdout: int,
        stderr: int,
    ) -> tuple[socket.socket, int]:
        """Fork a child running ``target`` (``"module:function"``, its return value the
        exit status) with ``sys.argv = argv``: its connection and PID."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.socket_path)
        header = {"target": target, "argv": list(argv), "env": dict(env), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(header).encode()], [stdin, stdout, stderr])
        conn.settimeout(60)
        msg = conn.recv(4096)
        if not msg:
            conn.close()
            raise RuntimeError(f"the engines' fork server closed the connection: {self.log_path}")
        return conn, int(json.loads(msg)["pid"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def children(self) -> list[ForkedProcess]:
        """Its children still running."""
        self._children = [c for c in self._children if c.poll() is None]
        return self._children

    def close(self) -> None:
        """Close the server's stdin: it SIGKILLs the children it still has and exits."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)


_servers: OrderedDict[tuple[Any, ...], ForkServer] = OrderedDict()
_servers_lock = threading.Lock()


def server_for(
    env: Mapping[str, str], log_dir: Path, preload: Sequence[str] = PRELOAD
) -> ForkServer:
    """The fork server whose children may run with ``env`` (started on first use)."""
    key = (tuple(preload), *import_env(env))
    with _servers_lock:
        server = _servers.pop(key, None)
        if server is not None and not server.alive():
            server = None
        if server is None:
            # The least recently used server without children goes; one whose children
            # still run stays (closing it would kill them).
            idle = [k for k, s in _servers.items() if not s.children()]
            while len(_servers) >= MAX_SERVERS and idle:
                _servers.pop(idle.pop(0)).close()
            server = ForkServer(env, log_dir, preload)
            for other in _servers.values():  # why another server: the differences
                diff = sorted(k for k in set(other.env) | set(env)
                              if k not in LAZY_ENV and other.env.get(k) != env.get(k))  # fmt: skip
                with server.log_path.open("a") as log:
                    log.write(
                        f"# besides the server at {other.socket_path}: env differs in {diff}\n"
                    )
        _servers[key] = server
        return server


@atexit.register
def close_all(preload: Sequence[str] | None = None) -> None:
    """Close every fork server this process started, or those that preloaded
    ``preload`` (their remaining children die)."""
    with _servers_lock:
        for key in [k for k in _servers if preload is None or k[0] == tuple(preload)]:
            _servers.pop(key).close()


def spawn(
    target: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_dir: Path,
    stderr: IO[Any],
    stdout: IO[Any] | None = None,
    preload: Sequence[str] = PRELOAD,
) -> ForkedProcess:
    """A child of the fork server for ``env`` running ``target``, with a pipe to its
    stdin and, unless ``stdout`` is given, from its stdout (both line-buffered text);
    its stderr into ``stderr``."""
    server = server_for(env, log_dir, preload)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe() if stdout is None else (-1, os.dup(stdout.fileno()))
    try:
        conn, pid = server.spawn(target, argv, env, in_r, out_w, stderr.fileno())
    except BaseException:
        for fd in (in_w, out_r):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(in_r)
        os.close(out_w)
    reader = os.fdopen(out_r, "r") if out_r >= 0 else None
    child = ForkedProcess(conn, pid, os.fdopen(in_w, "w", buffering=1), reader)
    server._children.append(child)
    return child


# ---- the server's side -----------------------------------------------------------------


def _child(header: dict[str, Any], fds: list[int], close: list[Any]) -> None:
    """In the forked child: never returns."""
    rc = 1
    try:
        for obj in close:
            with contextlib.suppress(Exception):
                obj.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.environ.clear()
        os.environ.update(header["env"])
        os.chdir(header["cwd"])
        sys.argv = list(header["argv"])
        module, func = header["target"].split(":")
        rc = int(getattr(importlib.import_module(module), func)() or 0)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, exit 1
        traceback.print_exc()
    finally:
        # What an interpreter's exit runs (Ray's shutdown, the connector's region release,
        # multiprocessing's finalizers), then gone without unwinding into the server's
        # loop.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)


def serve(path: str, preload: Sequence[str]) -> int:
    for name in preload:
        importlib.import_module(name)
    sel = selectors.DefaultSelector()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "driver")
    children: dict[int, socket.socket] = {}
    os.write(1, b"ready\n")
    os.dup2(2, 1)  # the driver reads no more of this stdout: prints go to the log
    try:
        while True:
            for key, _ in sel.select():
                if key.data == "accept":
                    conn, _ = listener.accept()
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    header = json.loads(msg)
                    closing = [sel, listener, conn, *children.values()]
                    pid = os.fork()
                    if pid == 0:
                        for fd in (wake_r, wake_w):
                            os.close(fd)
                        _child(header, fds, closing)
                    for fd in fds:
                        os.close(fd)
                    children[pid] = conn
                    conn.send(json.dumps({"pid": pid}).encode())
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    while children:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                        if pid == 0:
                            break
                        done = children.pop(pid, None)
                        if done is not None:
                            with contextlib.suppress(OSError):
                                done.send(json.dumps(
                                    {"returncode": os.waitstatus_to_exitcode(status)}
                                ).encode())  # fmt: skip
                            done.close()
                elif not os.read(sys.stdin.fileno(), 4096):  # the driver went away
                    return 0
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.unlink(path)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2:]))
