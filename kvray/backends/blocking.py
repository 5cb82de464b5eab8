"""Blocking calls off the event loop. Every adapter of a blocking client (Mooncake's,
datasystem's and MemCache's SDKs, the SSD tier's files, the checksum hasher) runs its
calls on threads of its own through one :class:`BlockingCalls`, and closes it one way:
new calls refused, the running ones waited for (off the loop), then the client's own
close."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvray.errors import BackendUnavailableError

_T = TypeVar("_T")


class BlockingCalls:
    """``await calls(fn, *args)`` runs ``fn`` on one of ``threads`` threads named
    ``kvray-<name>``; ``await calls.background(fn, *args)`` on one of as many threads
    named ``kvray-<name>-bg`` that run at ``background_niceness`` (stores: an engine's
    forward, on the same cores, comes first); once closed, a call raises
    :class:`BackendUnavailableError` naming ``what``."""

    def __init__(self, what: str, name: str, threads: int, *, background_niceness: int = 0) -> None:
        self._what = what
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"kvray-{name}")
        self._bg = ThreadPoolExecutor(
            max_workers=threads,
            thread_name_prefix=f"kvray-{name}-bg",
            initializer=_renice,
            initargs=(background_niceness,),
        )
        self.closed = False

    async def __call__(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        return await self._run(self._pool, fn, *args, **kw)

    async def background(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        """Like a call, on the background threads (their niceness: the constructor's)."""
        return await self._run(self._bg, fn, *args, **kw)

    async def _run(
        self, pool: ThreadPoolExecutor, fn: Callable[..., _T], *args: Any, **kw: Any
    ) -> _T:
        if self.closed:
            raise BackendUnavailableError(f"{self._what} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(fn, *args, **kw))

    async def close(self, last: Callable[[], object] | None = None) -> None:
        """Refuse new calls, wait for the running ones, then run ``last`` (the client's
        own close) on a thread; once."""
        if self.closed:
            return
        self.closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        await asyncio.to_thread(self._bg.shutdown, wait=True)
        if last is not None:
            await asyncio.to_thread(last)


def _renice(niceness: int) -> None:
    """The calling thread at ``niceness`` (Linux: a niceness is a thread's). Raising it
    needs no privilege; where the thread already runs nicer (Ray's workers start at 15),
    it keeps its own."""
    if niceness <= 0:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError:  # (no such call on this platform: the thread runs as it is)
        pass
