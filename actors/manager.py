"""PoolManager actor: owns a pool's spec and, in embedded mode, its ``mooncake_master``."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from kvray.config import PoolConfig
from kvray.master import MooncakeMaster


class PoolManagerActor:
    """One per pool. The embedded master is its child and dies with it."""

    def __init__(self, config_json: str) -> None:
        self._config = PoolConfig.model_validate_json(config_json)
        self._config_json = config_json
        self._master: MooncakeMaster | None = None
        address = self._config.mooncake.master_server_address
        if address is None:
            log_dir = os.path.join(tempfile.gettempdir(), "kvray", self._config.name)
            self._master = MooncakeMaster(self._config.master, log_dir)
            address = self._master.start()
        self._address = address
        self._started_at = time.time()

    async def spec(self) -> dict[str, Any]:
        return {
            "config_json": self._config_json,
            "server_address": self._address,
            "embedded": self._master is not None,
            "master_pid": self._master.pid if self._master else None,
            "master_alive": self._master.alive() if self._master else None,
            "started_at": self._started_at,
            "node_pid": os.getpid(),
        }

    async def stop(self) -> None:
        if self._master is not None:
            self._master.stop()
