"""Blocking calls off the event loop. Every adapter of a blocking client (Mooncake's,
datasystem's and MemCache's SDKs, the SSD tier's files, the checksum hasher) runs its
calls on threads of its own through one :class:`BlockingCalls`, and closes it one way:
new calls refused, the running ones waited for (off the loop), then the client's own
close."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvray.errors import BackendUnavailableError

_T = TypeVar("_T")


class BlockingCalls:
    """``await calls(fn, *args)`` runs ``fn`` on one of ``threads`` threads named
    ``kvray-<name>``; once closed, a call raises :class:`BackendUnavailableError` naming
    ``what``."""

    def __init__(self, what: str, name: str, threads: int) -> None:
        self._what = what
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"kvray-{name}")
        self.closed = False

    async def __call__(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        if self.closed:
            raise BackendUnavailableError(f"{self._what} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    async def close(self, last: Callable[[], object] | None = None) -> None:
        """Refuse new calls, wait for the running ones, then run ``last`` (the client's
        own close) on a thread; once."""
        if self.closed:
            return
        self.closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        if last is not None:
            await asyncio.to_thread(last)
