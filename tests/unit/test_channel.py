"""The node channel (:mod:`kvray.store.channel`) without Ray: a real server on an asyncio loop
(in a thread, or in a process the test kills) and the worker's client over a real Unix
socket. A step's calls go in one frame; every failure reaches the caller as a kvray
error, a dead peer at once; a broken channel re-attaches through the handle."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvray import remote
from kvray.errors import BackendUnavailableError, PoolFullError
from kvray.remote import CallTimeoutError
from kvray.store.channel import ChannelClient, ChannelServer, ChannelStore
from tests.fakes.pool_handles import FakeCall, FakeStore


class Served:
    """A ChannelServer on its own event loop thread, serving a few test calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.release = asyncio.Event()
        self.seen: list[str] = []

        async def echo(*args: Any) -> Any:
            self.seen.append("echo")
            return args

        async def held(value: Any) -> Any:
            await self.release.wait()
            return value

        async def full() -> None:
            raise PoolFullError("no room for 2 keys", {"a": "full", "b": "full"}, ["c"])

        async def bug() -> None:
            raise RuntimeError("kaboom")

        async def nap(seconds: float) -> str:
            await asyncio.sleep(seconds)
            return "rested"

        methods = {"echo": echo, "held": held, "full": full, "bug": bug, "nap": nap}
        self.server = ChannelServer("unit", methods)
        self.address = self.run(self.server.start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.run(self.server.close())
        self.run(asyncio.sleep(0.05))  # the connections' tasks end
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def test_a_steps_calls_go_in_one_frame_and_each_answers(served: Served) -> None:
    client = ChannelClient(served.address, "unit")
    calls = [client.call("echo", (i, "x"), f"echo {i}") for i in range(5)]
    assert client.frames == 0  # queued until the step flushes (or waits)
    assert remote.results(calls, 10) == [(i, "x") for i in range(5)]
    assert client.frames == 1
    assert served.server.connections == 1
    client.close()


def test_each_answer_says_how_long_the_actor_served_it(served: Served) -> None:
    client = ChannelClient(served.address, "unit")
    nap = client.call("nap", (0.05,), "nap")
    assert nap.served_s is None  # not answered yet
    assert nap.result(10) == "rested"
    assert nap.served_s is not None and nap.served_s >= 0.05
    client.close()


def test_kvray_errors_keep_their_type_and_others_are_named(served: Served) -> None:
    client = ChannelClient(served.address, "unit")
    full, bug, nothing = (client.call(m, (), m) for m in ("full", "bug", "nope"))
    client.flush()
    with pytest.raises(PoolFullError, match="no room for 2 keys") as err:
        full.result(10)
    assert err.value.failed == {"a": "full", "b": "full"} and err.value.stored == ["c"]
    with pytest.raises(BackendUnavailableError, match="unit.bug: RuntimeError: kaboom"):
        bug.result(10)
    with pytest.raises(BackendUnavailableError, match="serves no such call"):
        nothing.result(10)
    client.close()


def test_a_late_answer_times_out_then_settles_and_others_go_on(served: Served) -> None:
    client = ChannelClient(served.address, "unit")
    held = client.call("held", ("late",), "held")
    with pytest.raises(CallTimeoutError, match=r"held: no answer in 0.05 s \(call_timeout_s"):
        held.result(0.05, "call_timeout_s")
    assert remote.ready([held], 0) == [False]
    assert client.call("echo", (1,), "echo").result(10) == (1,)  # not stuck behind it
    served.loop.call_soon_threadsafe(served.release.set)
    assert remote.ready([held], 10) == [True]
    assert held.result(0) == "late"
    client.close()


def test_ready_waits_for_the_first_or_for_every_call(served: Served) -> None:
    client = ChannelClient(served.address, "unit")
    held = client.call("held", (1,), "held")
    quick = client.call("echo", (2,), "echo")
    assert remote.ready([held, quick], 10) == [False, True]
    assert remote.ready([held, quick], 0.05, every=True) == [False, True]
    served.loop.call_soon_threadsafe(served.release.set)
    assert remote.ready([held, quick], 10, every=True) == [True, True]
    client.close()


def test_a_waiter_whose_answer_another_thread_read_returns_at_once(served: Served) -> None:
    """Threads sharing one channel (a Pool's calls): while one waits for a call the actor
    holds, reading the socket, another's quick call answers; the reader settles it, and
    its waiter returns then, not when the held call ends (nothing more would come for it:
    it used to wait for the next answer or its whole timeout)."""
    client = ChannelClient(served.address, "unit")
    held = client.call("held", ("late",), "held")
    reader = threading.Thread(target=held.result, args=(30,))
    reader.start()
    while not client._recv_lock.locked():  # noqa: SLF001 - until the reader waits in select
        time.sleep(0.001)
    got: list[Any] = []
    quick = threading.Thread(
        target=lambda: got.append(client.call("echo", (7,), "echo").result(30))
    )
    quick.start()
    quick.join(10)  # (a stuck waiter would still be waiting: the held call is not released)
    assert not quick.is_alive() and got == [(7,)] and not held.settled
    served.loop.call_soon_threadsafe(served.release.set)
    reader.join(10)
    assert held.result(0) == "late"
    client.close()


def test_a_connection_from_another_user_is_refused(served: Served) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    code = (
        "import os, socket, sys; os.setuid(65534); s = socket.socket(socket.AF_UNIX);"
        "s.connect(chr(0) + sys.argv[1]); s.settimeout(10); print(repr(s.recv(1)))"
    )
    name = served.address.removeprefix("\0")  # argv holds no NUL
    out = subprocess.run(
        [sys.executable, "-c", code, name], capture_output=True, text=True, timeout=30
    )
    assert out.stdout.strip() == "b''", out.stderr  # closed at once, nothing served
    assert served.server.connections == 0


_ACTOR = """
import asyncio, sys
from kvray.store.channel import ChannelServer

async def main():
    async def echo(*args):
        return args
    async def never():
        await asyncio.Event().wait()
    server = ChannelServer("child", {"echo": echo, "never": never})
    print(await server.start(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class Child:
    """A ChannelServer in a process of its own (an actor the test can kill)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ACTOR], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().rstrip("\n")
        assert self.address.startswith("\0kvray-child-"), self.address

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for c in made:
        c.kill()


def test_a_peer_killed_mid_call_fails_the_calls_in_flight_at_once(children: list[Child]) -> None:
    child = Child()
    children.append(child)
    client = ChannelClient(child.address, "unit")
    assert client.call("echo", (1,), "echo").result(30) == (1,)
    pending = [client.call("never", (), f"load {i}") for i in range(3)]
    client.flush()
    child.kill()
    for call in pending:  # not a timeout: the closed socket answers
        with pytest.raises(BackendUnavailableError, match="closed by the actor") as err:
            call.result(60)
        assert not isinstance(err.value, CallTimeoutError)
    later = client.call("echo", (2,), "echo")
    with pytest.raises(BackendUnavailableError, match="closed by the actor"):
        later.result(60)


class ChildHandle(FakeStore):
    """A BackendClient handle whose ``channel`` answers the current child's address and
    whose Ray calls (the fallback) are the fake store's."""

    def __init__(self) -> None:
        super().__init__("FakeStore[0]")
        self.address = ""
        self.asked = 0

    def channel(self) -> FakeCall:  # type: ignore[override]
        self.asked += 1
        return FakeCall("FakeStore[0].channel", self.address)


def test_channel_store_falls_back_to_ray_and_reattaches(children: list[Child]) -> None:
    first = Child()
    children.append(first)
    handle = ChildHandle()
    handle.address = first.address
    store = ChannelStore(handle, 30)
    store.attach()
    assert store.attached and handle.asked == 1
    first.kill()
    second = Child()
    children.append(second)
    handle.address = second.address

    # The actor went while the worker was idle: the next call finds its channel closed
    # before sending on it, and goes through Ray instead of failing.
    assert store._live() is None and not store.attached
    # While the channel is down the transfers are Ray calls, and the handle is asked
    # again (at most every REATTACH_S); the first step after its answer connects.
    deadline = time.monotonic() + 30
    while not store.attached and time.monotonic() < deadline:
        assert store._live() is None or store.attached
        time.sleep(0.05)
    assert store.attached and handle.asked == 2
    assert store._live().call("echo", (3,), "echo").result(30) == (3,)  # type: ignore[union-attr]
    store.close()
