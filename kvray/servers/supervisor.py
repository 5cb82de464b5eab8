"""Keeping a pool's embedded server up: the pool manager's reconcile loop for it.

Checked every :data:`SUPERVISE_S`; a server that died (crash, OOM kill) is restarted on
the same address, so the pool's clients reconnect by themselves (what it held is gone:
those blocks read as misses). While restarts fail the checks back off, up to
:data:`RESTART_BACKOFF_MAX_S`. Each step logs, none raises.
"""

from __future__ import annotations

import asyncio
import logging

from kvray.servers.process import ServerProcess

logger = logging.getLogger(__name__)

SUPERVISE_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


class Supervisor:
    """Restarts ``server`` (of pool ``pool``) whenever it is found dead."""

    def __init__(
        self,
        server: ServerProcess,
        pool: str,
        *,
        every_s: float = SUPERVISE_S,
        backoff_max_s: float = RESTART_BACKOFF_MAX_S,
    ) -> None:
        self.server = server
        self.restarts = 0
        """Restarts that brought the server back."""
        self._pool = pool
        self._every_s = every_s
        self._backoff_max_s = backoff_max_s
        self._stopping = False

    def stop(self) -> None:
        """Stop restarting (the server is being stopped on purpose)."""
        self._stopping = True

    async def run(self) -> None:
        delay = self._every_s
        while not self._stopping:
            await asyncio.sleep(delay)
            if self._stopping or self.server.alive():
                delay = self._every_s
                continue
            delay = await self._restart(delay)

    async def _restart(self, delay: float) -> float:
        """One restart; the delay before the next check."""
        server, what = self.server, self.server.what
        logger.warning(
            "pool %s: the embedded %s (pid %s) died; restarting it on %s (the blocks it "
            "held are gone: they read as misses)",
            self._pool, what, server.pid, server.address,
        )  # fmt: skip
        try:
            await asyncio.to_thread(server.restart)
        except Exception as exc:
            delay = min(self._backoff_max_s, max(2 * delay, 2 * self._every_s))
            logger.error(
                "pool %s: restarting the %s failed (%s); next try in %.1f s",
                self._pool, what, exc, delay,
            )  # fmt: skip
            return delay
        self.restarts += 1
        logger.warning(
            "pool %s: the embedded %s is back on %s (pid %s, restart %d)",
            self._pool, what, server.address, server.pid, self.restarts,
        )  # fmt: skip
        return self._every_s
