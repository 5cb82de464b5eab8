"""The one lifecycle of kvray's child-process servers (kvray.servers.process), on a tiny
Python server: retry on a taken port, crash and restart on the same port, stop removes
its files, a refusal is not retried, a server that never comes up is reported with its
log."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from kvray.errors import BackendUnavailableError
from kvray.servers.process import ServerProcess, free_port, listens, why_unreachable
from kvray.servers.supervisor import Supervisor

_SERVE = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
open(sys.argv[2], "w").close()
print("listening", flush=True)
while True:
    time.sleep(1)
"""


class TinyServer(ServerProcess):
    what = "tiny server"
    stop_timeout_s = 5.0
    poll_s = 0.02

    def __init__(self, home: Path, ports: list[int] | None = None, *, serve: str = _SERVE):
        super().__init__("127.0.0.1")
        self.home = home
        self.port = 0
        self._ports = list(ports or [])
        self._serve = serve
        self.refuse: str | None = None
        self.launches = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-c", self._serve, str(self.port), str(self.home / "ready")]

    def _choose_ports(self) -> None:
        self.port = self._ports.pop(0) if self._ports else free_port(self.host)

    def _prepare(self) -> None:
        (self.home / "ready").unlink(missing_ok=True)
        self.launches += 1
        super()._prepare()

    def _ready(self) -> bool:
        return (self.home / "ready").exists()

    def _ready_timeout_s(self) -> float:
        return 10.0

    @property
    def _stdout_path(self) -> Path:
        return self.home / "logs" / "stdout.log"

    def _refusal(self) -> str | None:
        return self.refuse

    def _leftovers(self, pid: int) -> list[Path]:
        return [self.home.parent / f"leftover-{pid}"]

    def _own_dirs(self) -> list[Path]:
        return [self.home]


def test_retry_on_a_taken_port_then_crash_restart_and_stop(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        server = TinyServer(tmp_path / "home", [busy])
        address = server.start()
    assert server.port != busy and address == server.address and server.alive()
    assert why_unreachable(address, 1.0) is None
    pid = server.pid
    assert pid is not None
    (tmp_path / f"leftover-{pid}").touch()
    server.kill()
    assert not server.alive() and why_unreachable(address, 1.0) is not None
    assert server.restart() == address, "a restart keeps the address its clients know"
    assert server.alive() and server.pid != pid
    assert not (tmp_path / f"leftover-{pid}").exists()
    assert "listening" in server.log_tail()
    server.stop()
    assert not server.alive() and server.pid is None
    assert not (tmp_path / "home").exists()


_SLOW_BIND = """
import socket, sys, time
time.sleep(0.5)  # another process takes the port before this one binds it
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    time.sleep(1)
"""


class PortServer(TinyServer):
    """Ready when its port accepts, as the master and the datasystem worker are."""

    def _ready(self) -> bool:
        return self._accepts(self.port, 0.2)


def test_a_port_another_process_listens_on_is_not_the_server_ready(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        server = PortServer(tmp_path / "home", [busy], serve=_SLOW_BIND)
        address = server.start()
        # the first attempt's child found the port taken and exited: not ready, retried
        assert server.launches == 2 and server.port != busy and server.alive()
        assert listens(server.pid, server.port) and not listens(server.pid, busy)
    assert why_unreachable(address, 1.0) is None
    server.stop()


def test_a_server_that_never_comes_up_is_reported_with_its_log(tmp_path):
    server = TinyServer(tmp_path / "home", serve="print('no such luck', flush=True)")
    with pytest.raises(BackendUnavailableError, match="did not start after 2 attempts") as err:
        server.start(timeout_s=5.0, attempts=2)
    assert server.launches == 2 and "no such luck" in str(err.value)
    assert not server.alive() and not (tmp_path / "home").exists()


def test_a_refusal_is_raised_without_retrying(tmp_path):
    server = TinyServer(tmp_path / "home", serve="raise SystemExit(3)")
    server.refuse = "one per host: stop the other one"
    with pytest.raises(BackendUnavailableError, match="one per host"):
        server.start(attempts=3)
    assert server.launches == 1 and not (tmp_path / "home").exists()


async def _until(condition, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_the_supervisor_restarts_a_dead_server_on_its_address(tmp_path):
    server = TinyServer(tmp_path / "home")
    address = server.start()
    supervisor = Supervisor(server, "p", every_s=0.05)
    task = asyncio.create_task(supervisor.run())
    try:
        for n in (1, 2):
            pid = server.pid
            server.kill()
            await _until(lambda n=n: supervisor.restarts == n and server.alive())
            assert server.address == address and server.pid != pid
    finally:
        supervisor.stop()
        await asyncio.wait_for(task, 5)
        server.stop()


async def test_the_supervisor_backs_off_while_restarts_fail_and_stops_on_request(tmp_path):
    server = TinyServer(tmp_path / "home")
    server.start()
    supervisor = Supervisor(server, "p", every_s=0.05, backoff_max_s=0.2)
    good, server._serve = server._serve, "raise SystemExit(3)"  # every restart now fails
    server.kill()
    launches = server.launches
    task = asyncio.create_task(supervisor.run())
    await _until(lambda: server.launches >= launches + 3)
    assert supervisor.restarts == 0  # failed restarts are not counted as restarts
    server._serve = good
    await _until(lambda: supervisor.restarts == 1 and server.alive())
    supervisor.stop()
    await asyncio.wait_for(task, 5)
    server.kill()
    await asyncio.sleep(0.3)  # six check periods: a running supervisor would restart it
    assert supervisor.restarts == 1 and not server.alive()
    server.stop()
