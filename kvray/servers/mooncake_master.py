"""Run ``mooncake_master`` as a child process: the embedded default of the ``mooncake``
backend when no master address is configured.

The master listens on free loopback ports (RPC and metrics; two masters never collide
on the default metrics port 9003); it is ready when it listens on its RPC port itself and
that port accepts.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from kvray.config import MooncakeMasterConfig
from kvray.errors import ConfigError
from kvray.servers.process import ServerProcess, free_port


def find_master_binary() -> str:
    """``mooncake_master`` next to the running interpreter (a venv), else on PATH."""
    candidate = Path(sys.executable).parent / "mooncake_master"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mooncake_master")
    if found is None:
        raise ConfigError(
            "mooncake_master is not installed: pip install 'kvray[cpu]' (or [cuda]/[npu]), "
            "or set mooncake.master_server_address / MOONCAKE_MASTER to a running master"
        )
    return found


class MooncakeMaster(ServerProcess):
    """One ``mooncake_master`` child process on loopback."""

    what = "mooncake_master"
    stop_timeout_s = 5.0
    poll_s = 0.05

    def __init__(
        self,
        config: MooncakeMasterConfig,
        log_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(host)
        self.config = config
        self.log_path = Path(log_dir) / f"mooncake_master-{os.getpid()}.log"
        self.rpc_port = 0
        self.metrics_port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def command(self) -> list[str]:
        c = self.config
        return [
            find_master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--eviction_high_watermark_ratio={c.eviction_high_watermark_ratio}",
            f"--eviction_ratio={c.eviction_ratio}",
            f"--default_kv_lease_ttl={c.default_kv_lease_ttl_ms}",
            f"--client_ttl={c.client_ttl_s}",
            *(["--enable_offload=true"] if c.enable_offload else []),
            *c.extra_args,
        ]

    def scrape_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def _choose_ports(self) -> None:
        self.rpc_port, self.metrics_port = free_port(self.host), free_port(self.host)

    def _ready(self) -> bool:
        return self._accepts(self.rpc_port, 0.2)

    def _ready_timeout_s(self) -> float:
        return 15.0

    @property
    def _stdout_path(self) -> Path:
        return self.log_path
