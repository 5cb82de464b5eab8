"""A benchmark's vLLM OpenAI server, forked from the engines' fork server
(:mod:`kvray.testing.forkserver`) when ``KVRAY_ENGINE_FORK=1`` (the test suite's smoke
runs), else a fresh ``python -m vllm.entrypoints.openai.api_server`` as users start it.

A fresh server on the CPU backend is three interpreters that each import vLLM: the API
server, its engine core and the engine core's worker (vLLM's CPU platform starts both
with ``spawn``, whatever ``VLLM_WORKER_MULTIPROC_METHOD`` says), ~35 s of a 2-core
machine per server before it loads the model. Forked, the API server starts with vLLM
imported, and starts its engine core and worker with ``fork`` instead, so they do too.
What runs is otherwise the same: vLLM's server ``main`` with the same arguments, model,
KV cache and connector, in the same three processes.

The forked server leads a process group of its own, as :class:`Server`'s fresh one does,
so pausing, stopping and the stack dump of a failing start reach its engine processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from kvray.testing import forkserver
from kvray.testing.engine import FORK_ENV
from kvray.testing.server import Server

HERE = Path(__file__).resolve().parent
SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
"""What ``python -m vllm.entrypoints.openai.api_server`` runs (its ``main``)."""
PRELOAD = (*forkserver.PRELOAD, SERVE_MODULE, "vllm.v1.engine.core", "_forked_server")
LATE_ENV = frozenset({"MOONCAKE_CONFIG_PATH", "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"})
"""Variables the child sets itself (passed on its command line), so that servers that
differ only in them share one fork server: each is read when an engine's connector
starts, never at import (the peer baseline's Mooncake client config)."""


def forking() -> bool:
    """Whether the run forks its servers (``KVRAY_ENGINE_FORK=1``)."""
    return os.environ.get(FORK_ENV) == "1"


def start_server(name: str, cmd: list[str], env: dict[str, str], log: Path, *, port: int) -> Server:
    """:class:`Server` for ``cmd`` (a :func:`vllm_serve_cmd`), forked where the run asks
    for it."""
    if not forking():
        return Server(name, cmd, env, log, port=port)
    return ForkedServer(name, cmd, env, log, port=port)


def prestart(env: dict[str, str], log_dir: Path) -> threading.Thread | None:
    """When forking: the fork server for ``env`` started now, in a thread (its import of
    vLLM overlaps what the run starts meanwhile: Ray, the pool); the first server waits
    for it. ``env``: the servers' (its variables read at import must be theirs)."""
    if not forking():
        return None
    t = threading.Thread(
        target=forkserver.server_for, args=(_env(env), log_dir, PRELOAD), daemon=True
    )
    t.start()
    return t


def _env(env: dict[str, str]) -> dict[str, str]:
    return {
        **{k: v for k, v in env.items() if k not in LATE_ENV},
        "PYTHONFAULTHANDLER": "1",  # as Server's: see its dump_stacks
        # the fork server imports this module (its children's target) from here
        "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])]),
    }


class ForkedServer(Server):
    """:class:`Server` whose process is a child of the fork server."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], log: Path, *, port: int
    ) -> None:
        module = cmd.index("-m") + 1
        if cmd[module] != "vllm.entrypoints.openai.api_server":
            raise ValueError(f"{name}: only vLLM's OpenAI server forks, not {cmd}")
        self.name, self.log, self.port = name, log, port
        self._out = open(log, "w")  # noqa: SIM115 (closed in stop)
        late = json.dumps({k: v for k, v in env.items() if k in LATE_ENV})
        self.proc = forkserver.spawn(  # type: ignore[assignment]  # Popen's interface, in part
            "_forked_server:serve", [SERVE_MODULE, late, *cmd[module + 1 :]], _env(env),
            log.parent, stderr=self._out, stdout=self._out, preload=PRELOAD,
        )  # fmt: skip

    def stop(self, grace_s: float = 60.0) -> None:
        """:meth:`Server.stop`, then the shared memory its processes had mapped unlinked
        where it is left: vLLM unlinks its psm_* queues in ``__del__``, which a forked
        engine process skips (it ends in ``os._exit``, as multiprocessing's fork does)."""
        mapped = _shm_mapped(self.proc.pid)
        super().stop(grace_s)
        for path in mapped:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _shm_mapped(pgid: int) -> set[Path]:
    """The /dev/shm files mapped by the processes of group ``pgid``."""
    found: set[Path] = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) != pgid:
                continue
            for m in proc.memory_maps(grouped=True):
                if m.path.startswith("/dev/shm/"):
                    found.add(Path(m.path))
    return found


def serve() -> None:
    """In the forked child: a process group of its own; the engine core and its worker
    forked (vLLM asks its multiprocessing context of ``get_mp_context``, which on CPU
    always answers ``spawn``); then vLLM's server ``main``. ``sys.argv[1]``: the
    :data:`LATE_ENV` variables (JSON)."""
    os.setsid()
    os.environ.update(json.loads(sys.argv.pop(1)))
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils
    import vllm.v1.executor.multiproc_executor as executor
    from vllm.entrypoints.launchers.api_server.entry import main

    fork = multiprocessing.get_context("fork")
    engine_utils.get_mp_context = executor.get_mp_context = lambda: fork  # type: ignore[attr-defined]
    main()  # type: ignore[no-untyped-call]  # vLLM: untyped


def wait_all_healthy(servers: list[Server], timeout_s: float = 600.0) -> None:
    """Until every server of ``servers`` (started together) is healthy, each paused as
    soon as it is (an idle engine's polling would take the cores from those still
    starting); a server that exits or is not healthy in ``timeout_s`` fails as in
    :meth:`Server.wait_healthy`."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None or time.monotonic() > deadline:
                s.wait_healthy(deadline)  # raises ServerFailed with the server's log
            with contextlib.suppress(OSError), urllib.request.urlopen(s.url("/health"), timeout=2):
                s.pause()
                pending.remove(s)
        time.sleep(0.5)
