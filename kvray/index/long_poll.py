"""A long poll's server side: a call is held until what it asks for is there, or its wait
ran out. The pool manager answers the nodes' block-index keepers (``index_since``) and the
Lookup actors' ledger follows (``ledger_since``) this way, so an idle pool makes one call
per wait, not one per polling interval."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LongPoll:
    """Callers held by :meth:`wait` until ``ready()`` or their wait ran out; :meth:`changed`
    (after each change of what they ask about) has them check again. One event loop (the
    actor's) runs both."""

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None

    def changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def wait(self, ready: Callable[[], bool], wait_s: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._changed.clear()  # (no await since ready(): no change is missed)
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return
