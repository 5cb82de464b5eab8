"""openYuanrong datasystem: the client of each rank, configured as vLLM-Ascend
deployments do through ``DS_WORKER_ADDR``, ``DATASYSTEM_CLIENT_LOG_DIR``,
``DS_ENABLE_EXCLUSIVE_CONNECTION`` and ``DS_ENABLE_REMOTE_H2D`` (read once, in
:meth:`YuanrongConfig.from_env`), and the worker kvray runs itself."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kvray.config._common import (
    ByteSize,
    ExtraArgs,
    GiB,
    HostPort,
    MiB,
    _env_flag,
    _Strict,
    validate,
)
from kvray.errors import ConfigError


class YuanrongConfig(_Strict):
    """The openYuanrong datasystem client of each rank, as vLLM-Ascend deployments
    configure it through the environment (:meth:`from_env`)."""

    worker_address: HostPort | None = None
    """``host:port`` of the datasystem worker on the rank's node (``DS_WORKER_ADDR``; it
    must match that worker's ``dscli start --worker_address``). Unset: kvray starts a
    worker itself (embedded metastore, no etcd), for a pool on one node."""
    node_worker_addresses: dict[str, HostPort] = Field(default_factory=dict)
    """The datasystem worker of each node for pools that span nodes: node IP (the address
    Ray knows the node by, ``ray start --node-ip-address``) to that node's worker
    ``host:port``. Every client connects to its own node's worker (clients share memory
    with it); every worker must share one etcd or metastore. Empty: every client uses
    ``worker_address``."""
    client_log_dir: str = Field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "kvray", "ds-client-logs")
    )
    """Client SDK log directory (``DATASYSTEM_CLIENT_LOG_DIR``; the SDK's own default is
    the home directory, ~55 MB per 25 min)."""
    enable_exclusive_connection: bool = True
    """``DS_ENABLE_EXCLUSIVE_CONNECTION``: a dedicated client-worker connection (faster
    IPC; a worker accepts at most 128 such clients; kvray opens two per rank)."""
    enable_remote_h2d: bool = False
    """``DS_ENABLE_REMOTE_H2D``: remote host-to-device reads on the NPU device path."""
    connect_timeout_ms: int = Field(5000, ge=100, le=600_000)
    """Client connect timeout; always passed (the SDK default blocks 60 s per failure)."""
    request_timeout_ms: int = Field(5000, ge=100, le=600_000)
    """Timeout of one request: a dead worker is reported within this, not after 60 s."""
    write_mode: Literal["evict", "keep"] = "evict"
    """``evict``: a full worker evicts older blocks for new ones (what a cache wants).
    ``keep``: blocks stay until removed and a put into a full worker reports pool full."""
    device: Literal["host", "npu"] = "host"
    """Data path: ``host`` (KVClient zero-copy shared-memory buffers, any machine) or
    ``npu`` (HeteroClient device-to-host / host-to-device calls; Ascend NPUs only)."""

    @model_validator(mode="after")
    def _distinct(self) -> YuanrongConfig:
        if self.node_worker_addresses and self.worker_address is None:
            raise ValueError(
                "node_worker_addresses needs external workers: set worker_address too "
                "(DS_WORKER_ADDR), e.g. to the head node's worker"
            )
        return self

    def address_on(self, node_ip: str) -> str | None:
        """The worker the clients on node ``node_ip`` connect to (None: the embedded
        worker)."""
        if not self.node_worker_addresses:
            return self.worker_address
        try:
            return self.node_worker_addresses[node_ip]
        except KeyError:
            raise ConfigError(
                f"yuanrong.node_worker_addresses has no worker for node {node_ip} (it has "
                f"{', '.join(sorted(self.node_worker_addresses))}): start a datasystem worker "
                f'on that node and add "{node_ip}": "<its host:port>"'
            ) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> YuanrongConfig:
        """Read the deployment variables once, here, into the typed config."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        if "DS_WORKER_ADDR" in env:
            if not env["DS_WORKER_ADDR"].strip():
                raise ConfigError(
                    "DS_WORKER_ADDR is set but empty: unset it (kvray then starts a worker "
                    "itself) or give the local worker's host:port"
                )
            data["worker_address"] = env["DS_WORKER_ADDR"].strip()
        if env.get("DATASYSTEM_CLIENT_LOG_DIR", "").strip():
            data["client_log_dir"] = env["DATASYSTEM_CLIENT_LOG_DIR"].strip()
        for var, fld in (
            ("DS_ENABLE_EXCLUSIVE_CONNECTION", "enable_exclusive_connection"),
            ("DS_ENABLE_REMOTE_H2D", "enable_remote_h2d"),
        ):
            flag = _env_flag(env, var)
            if flag is not None:
                data[fld] = flag
        return validate(cls, data, source="yuanrong config (DS_* environment)")


class DatasystemWorkerConfig(_Strict):
    """The datasystem worker kvray runs itself when no worker address is configured:
    embedded metastore (no etcd), loopback, a fresh data directory per pool."""

    shared_memory_size: ByteSize = GiB
    """Shared memory the worker caches blocks in (``--shared_memory_size_mb``)."""
    threads: int = Field(4, ge=1, le=256)
    """Object-cache and RPC threads (``--oc_thread_num``, ``--rpc_thread_num``)."""
    data_dir: str | None = None
    """Parent of the per-pool worker directory (default: the system temp directory)."""
    ready_timeout_s: float = Field(60.0, gt=0)
    """How long the worker may take to become ready (~6 s on an idle 2-core machine)."""
    extra_args: ExtraArgs = ()
    """Further ``--flag=value`` worker flags passed through verbatim."""

    @field_validator("shared_memory_size")
    @classmethod
    def _shm_min(cls, v: int) -> int:
        if v < 64 * MiB:
            raise ValueError(f"must be at least 64MB, got {v} bytes")
        return v
