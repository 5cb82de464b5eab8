"""The one helper every blocking-client adapter runs its calls through: calls run on the
adapter's own named threads, off the event loop; close refuses new calls, waits for the
running ones, then runs the client's own close, once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvray.backends.blocking import BlockingCalls
from kvray.errors import BackendUnavailableError


def test_calls_run_on_the_adapters_own_threads_off_the_loop():
    async def main() -> tuple[str, int]:
        calls = BlockingCalls("test client", "unit", 2)
        try:
            name = await calls(lambda: threading.current_thread().name)
            return name, await calls(lambda a, *, b: a + b, 1, b=2)
        finally:
            await calls.close()

    name, total = asyncio.run(main())
    assert name.startswith("kvray-unit") and total == 3


def test_close_waits_for_running_calls_then_runs_the_clients_close_once():
    order: list[str] = []
    release = threading.Event()

    def slow() -> None:
        release.wait(5)
        order.append("call ended")

    async def main() -> None:
        calls = BlockingCalls("test client", "unit", 2)
        running = asyncio.ensure_future(calls(slow))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(calls.close(lambda: order.append("client closed")))
        await asyncio.sleep(0.05)
        assert not closing.done()  # the loop kept running while close waited
        with pytest.raises(BackendUnavailableError, match="test client is closed"):
            await calls(slow)
        release.set()
        await asyncio.gather(running, closing)
        await calls.close(lambda: order.append("closed twice"))

    asyncio.run(main())
    assert order == ["call ended", "client closed"]


def test_background_calls_run_on_threads_of_their_own_niceness():
    """Stores run on background threads at ``background_niceness`` (an engine's forward
    on the same cores comes first); other calls keep the process's niceness."""
    import os
    import threading

    def niceness() -> tuple[str, int]:
        me = threading.current_thread().name
        return me, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, 0)
    want = max(base, 7)

    async def main() -> tuple[tuple[str, int], tuple[str, int]]:
        calls = BlockingCalls("test client", "t", 2, background_niceness=7)
        try:
            return await calls(niceness), await calls.background(niceness)
        finally:
            await calls.close()

    (fg_name, fg), (bg_name, bg) = asyncio.run(main())
    assert fg_name.startswith("kvray-t_") and fg == base
    assert bg_name.startswith("kvray-t-bg") and bg == want
