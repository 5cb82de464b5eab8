"""PoolManager actor: owns a pool's spec and, in embedded mode, the backend's server:
a ``mooncake_master``, a datasystem worker with its embedded metastore, or a MemCache
MetaService."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import ray

from kvray.config import PoolConfig
from kvray.datasystem import DatasystemWorker
from kvray.master import MooncakeMaster
from kvray.mmc_meta import MetaService

SERVER_KIND = {
    "mooncake": "mooncake_master",
    "yuanrong": "datasystem worker",
    "memcache": "MemCache MetaService",
}


class PoolManagerActor:
    """One per pool. The embedded server is its child and dies with it."""

    def __init__(self, config_json: str) -> None:
        self._config = config = PoolConfig.model_validate_json(config_json)
        self._config_json = config_json
        self._server: MooncakeMaster | DatasystemWorker | MetaService | None = None
        self._server_kind = SERVER_KIND[config.backend]
        self._resolved: dict[str, Any] = {}
        if config.backend == "memcache":
            address = config.memcache.meta_service_url
            if address is None:
                meta = MetaService(config.memcache_meta, name=config.name)
                self._server = meta
                address = meta.start()
                # Clients need the config store too; the launcher passes both on.
                self._resolved = {
                    "meta_service_url": meta.meta_service_url,
                    "config_store_url": meta.config_store_url,
                }
        elif config.backend == "yuanrong":
            address = config.yuanrong.worker_address
            if address is None:
                self._server = DatasystemWorker(config.datasystem, name=config.name)
                address = self._server.start()
        else:
            address = config.mooncake.master_server_address
            if address is None:
                log_dir = os.path.join(tempfile.gettempdir(), "kvray", config.name)
                master = config.master
                if config.mooncake.enable_ssd_offload and not master.enable_offload:
                    master = master.model_copy(update={"enable_offload": True})
                self._server = MooncakeMaster(master, log_dir)
                address = self._server.start()
        self._address = address
        self._started_at = time.time()

    async def spec(self) -> dict[str, Any]:
        return {
            "config_json": self._config_json,
            "server_address": self._address,
            "server_kind": self._server_kind,
            "embedded": self._server is not None,
            "server_pid": self._server.pid if self._server else None,
            "server_alive": self._server.alive() if self._server else None,
            "started_at": self._started_at,
            "node_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "resolved": self._resolved,
        }

    async def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
