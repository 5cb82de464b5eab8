"""Typed configuration, validated at load time.

Three models, each ``extra="forbid"`` so that a typo fails when the config is read,
not an hour into serving:

- :class:`MooncakeConfig`: the Mooncake client, loaded from ``mooncake.json`` (the file
  ``MOONCAKE_CONFIG_PATH`` names) exactly as vLLM-Ascend deployments write it.
- :class:`ConnectorConfig`: the ``kv_connector_extra_config`` keys, the same as
  AscendStoreConnector's, plus kvray's own.
- :class:`PoolConfig`: one pool: its name, ranks, backend section, embedded servers.

The environment is read once, at the edge (``from_env``), never at import time.

Precedence for Mooncake (highest first): ``MOONCAKE_MASTER`` and
``MOONCAKE_GLOBAL_SEGMENT_SIZE`` environment variables, then ``mooncake.json``, then
the defaults below. For openYuanrong datasystem (:class:`YuanrongConfig`) the variables
vLLM-Ascend deployments set (``DS_WORKER_ADDR``, ``DATASYSTEM_CLIENT_LOG_DIR``,
``DS_ENABLE_EXCLUSIVE_CONNECTION``, ``DS_ENABLE_REMOTE_H2D``) are read the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import Self

from kvray.errors import ConfigError
from kvray.sizes import parse_size

_M = TypeVar("_M", bound=BaseModel)

GiB = 1 << 30
MiB = 1 << 20

Protocol = Literal["tcp", "rdma", "ascend"]


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


BackendName = Literal["mooncake", "yuanrong", "memcache"]
MmcProtocol = Literal[
    "device_rdma",
    "device_urma",
    "device_uboe",
    "device_sdma",
    "host_shm",
    "host_urma",
    "host_rdma",
    "host_tcp",
]
TiB = 1 << 40


def _size(value: Any) -> Any:
    # pydantic reports the field name itself; keep the message about the value.
    return parse_size(value, field="value") if isinstance(value, int | str) else value


ByteSize = Annotated[int, BeforeValidator(_size), Field(ge=0)]


def _flags(value: Any) -> Any:
    for arg in value if isinstance(value, list | tuple) else ():
        if not isinstance(arg, str) or not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"each extra arg must look like '--flag=value', got {arg!r}")
    return value


ExtraArgs = Annotated[tuple[str, ...], BeforeValidator(_flags)]
"""Command-line flags passed through verbatim to a server kvray runs."""


def parse_host_port(value: str, *, field: str) -> tuple[str, int]:
    """Split ``host:port``; raise ``ValueError`` naming ``field`` if malformed."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(
            f"{field}: expected 'host:port' with a port in 1..65535, got {value!r} "
            "(for example '127.0.0.1:50051')"
        )
    return host.strip("[]"), int(port_s)


def _host_port(value: Any) -> Any:
    if isinstance(value, str):
        parse_host_port(value, field="value")
    return value


HostPort = Annotated[str, BeforeValidator(_host_port)]


def detect_protocol(
    dev_root: Path = Path("/dev"), ib_root: Path = Path("/sys/class/infiniband")
) -> Protocol:
    """Pick Mooncake's transport by hardware: Ascend NPUs -> ``ascend``, RDMA NICs ->
    ``rdma``, otherwise ``tcp``. Looks at device nodes only (no driver import)."""
    if any(dev_root.glob("davinci[0-9]*")):
        return "ascend"
    if ib_root.is_dir() and any(ib_root.iterdir()):
        return "rdma"
    return "tcp"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


_OFFLOAD_ENV = {
    "local_buffer_size_bytes": "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES",
    "bucket_max_total_size": "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE",
    "bucket_eviction_policy": "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY",
    "total_size_limit_bytes": "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES",
    "bucket_keys_limit": "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT",
    "storage_backend_descriptor": "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR",
    "heartbeat_interval_seconds": "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS",
}


class MooncakeOffloadConfig(_Strict):
    """Mooncake's native SSD offload knobs, which Mooncake reads from the environment of
    each client process (kvray passes them to the BackendClient actors). Mooncake reads
    byte counts as plain integers and silently falls back to its defaults for anything
    else, so kvray refuses ``"10G"`` and friends instead."""

    local_buffer_size_bytes: int | None = Field(None, gt=0)
    """``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES``: per-rank SSD I/O buffer (default 1.25 GB)."""
    bucket_max_total_size: int | None = Field(None, ge=0)
    """``MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE``: eviction threshold (0: 90 % of the disk)."""
    bucket_eviction_policy: Literal["none", "fifo", "lru"] | None = None
    """``MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY`` (Mooncake reads any other word as none)."""
    total_size_limit_bytes: int | None = Field(None, gt=0)
    """``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES``: per-rank disk quota (default 2 TB:
    always set it; larger than the disk under ssd_offload_path is refused)."""
    bucket_keys_limit: int | None = Field(None, gt=0)
    """``MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT``: keys per bucket file (default 500)."""
    storage_backend_descriptor: (
        Literal["bucket_storage_backend", "file_per_key_storage_backend"] | None
    ) = None
    """``MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR``."""
    heartbeat_interval_seconds: int | None = Field(None, gt=0)
    """``MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS`` (default 10)."""

    def env(self) -> dict[str, str]:
        return {
            var: str(getattr(self, f))
            for f, var in _OFFLOAD_ENV.items()
            if getattr(self, f) is not None
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MooncakeOffloadConfig:
        data: dict[str, Any] = {}
        for f, var in _OFFLOAD_ENV.items():
            if var not in env:
                continue
            value = env[var].strip()
            if f in ("bucket_eviction_policy", "storage_backend_descriptor"):
                data[f] = value
            elif not value.isdigit():
                raise ConfigError(
                    f"{var} must be a plain number of bytes (digits only), got {value!r}: "
                    "Mooncake ignores other spellings such as '10G' and silently uses its "
                    f"default (write e.g. {10 * GiB} for 10 GiB)"
                )
            else:
                data[f] = int(value)
        return validate(cls, data, source="MOONCAKE_OFFLOAD_* environment")


class MooncakeConfig(_Strict):
    """The Mooncake client, as ``mooncake.json`` describes it."""

    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata: ``P2PHANDSHAKE`` (no server), ``http://host:port/metadata``
    or an etcd address."""
    protocol: Annotated[Protocol, BeforeValidator(_lower)] = Field(default_factory=detect_protocol)
    """Transport: ``tcp``, ``rdma`` or ``ascend`` (any case: the seeds write ``Ascend``).
    Default chosen by hardware."""
    device_name: str = ""
    """RDMA device list (e.g. ``mlx5_0,mlx5_1``); empty lets Mooncake choose."""
    master_server_address: HostPort | None = None
    """``host:port`` of a running ``mooncake_master``. Unset: kvray runs one itself."""
    global_segment_size: ByteSize = GiB
    """Memory each BackendClient contributes to the pool ("1GB", "1024MB", int bytes)."""
    local_buffer_size: ByteSize = 256 * MiB
    """Client-local transfer buffer Mooncake allocates for its own copies."""
    preferred_segment: bool = False
    """Place every put in this rank's own segment (reads stay process-local)."""
    prefer_alloc_in_same_node: bool = True
    """Prefer segments on the writer's node. Mooncake 0.3.13 rejects this flag on its
    zero-copy batch puts, so kvray implements it by preferring the local segment."""
    local_hostname: str | None = None
    """Address this client advertises to peers. Unset: the address Ray knows the client's
    node by (each node's clients advertise their own); set it only for a one-node pool
    or an interface other than Ray's."""
    fabric_mem: bool = False
    """``ASCEND_ENABLE_USE_FABRIC_MEM=1``: segments must be multiples of 1 GiB."""
    enable_ssd_offload: bool = False
    """Mooncake's native SSD offload (the master then runs with ``--enable_offload``)."""
    ssd_offload_path: str | None = None
    """Where each client writes offloaded objects: absolute, existing, writable, no
    symlinks or ``..`` (checked where the config is loaded and in each actor)."""
    offload: MooncakeOffloadConfig = Field(default_factory=MooncakeOffloadConfig)
    """``MOONCAKE_OFFLOAD_*`` environment knobs, validated."""
    tenant_id: str = Field("default", min_length=1)
    """Passed to Mooncake's client (``setup(tenant_id=...)``). Measured: the Mooncake this
    runs does not separate keys by tenant; separate with ``model_namespace`` instead."""
    enable_client_http_server: bool = False
    """Each storing client serves Mooncake's client HTTP endpoints (health, metrics) on
    ``client_http_port`` + its slot (several clients share a node)."""
    client_http_port: int = Field(9300, ge=1, le=65535)
    """First port of the clients' HTTP endpoints (``enable_client_http_server``)."""
    mode: str | None = None
    """Accepted from seed ``mooncake.json`` files and ignored: Mooncake's own client does
    not read it either (``mooncake_config.py``)."""

    @model_validator(mode="before")
    @classmethod
    def _enable_offload(cls, data: Any) -> Any:
        """``enable_offload`` (the master's flag name, as some seed files write it in
        ``mooncake.json``) means the client's ``enable_ssd_offload``."""
        if isinstance(data, dict) and "enable_offload" in data:
            data = dict(data)
            value = data.pop("enable_offload")
            if "enable_ssd_offload" in data and bool(data["enable_ssd_offload"]) != bool(value):
                raise ValueError(
                    "enable_offload and enable_ssd_offload disagree: they are one setting "
                    "(Mooncake's client SSD offload); keep enable_ssd_offload"
                )
            data["enable_ssd_offload"] = value
        return data

    @field_validator("global_segment_size")
    @classmethod
    def _segment_min(cls, v: int) -> int:
        # Measured: mooncake 0.3.13 setup() answers -600 for any segment under 16 MiB.
        if v != 0 and v < 16 * MiB:
            raise ValueError(
                f"must be 0 (a client that contributes no memory) or at least 16MB, got {v} "
                "bytes (Mooncake rejects smaller segments)"
            )
        return v

    @field_validator("local_buffer_size")
    @classmethod
    def _buffer_min(cls, v: int) -> int:
        if v != 0 and v < 1024:
            raise ValueError("must be 0 or at least 1KB")
        return v

    @model_validator(mode="after")
    def _offload(self) -> MooncakeConfig:
        if not self.enable_ssd_offload:
            return self
        if self.ssd_offload_path is None:
            raise ValueError("enable_ssd_offload needs ssd_offload_path (a directory on the SSD)")
        from kvray.paths import check_dir

        try:
            root = check_dir(self.ssd_offload_path, field="ssd_offload_path")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        limit = self.offload.total_size_limit_bytes
        if limit is not None and limit > shutil.disk_usage(root).total:
            raise ValueError(
                f"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES={limit} is larger than the disk "
                f"under {root} ({shutil.disk_usage(root).total} bytes): lower it"
            )
        return self

    @model_validator(mode="after")
    def _fabric_alignment(self) -> MooncakeConfig:
        if self.fabric_mem and self.global_segment_size % GiB:
            raise ValueError(
                "global_segment_size must be a multiple of 1GB when "
                f"ASCEND_ENABLE_USE_FABRIC_MEM=1, got {self.global_segment_size} bytes "
                "(write e.g. '1GB' or '2GB'; '1280MB' or '1.5GB' fail in aclrtMapMem)"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MooncakeConfig:
        """Load as deployments do: ``MOONCAKE_CONFIG_PATH`` json, then env overrides."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        source = "defaults"
        path = env.get("MOONCAKE_CONFIG_PATH")
        if path is not None:
            data = _read_json(path, "MOONCAKE_CONFIG_PATH")
            source = path
        for var, fld in (
            ("MOONCAKE_MASTER", "master_server_address"),
            ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
        ):
            if var in env:
                if not env[var].strip():
                    raise ConfigError(f"{var} is set but empty: unset it or give a value for {fld}")
                data[fld] = env[var]
        if env.get("ASCEND_ENABLE_USE_FABRIC_MEM") == "1":
            data["fabric_mem"] = True
        offload = MooncakeOffloadConfig.from_env(env)
        if offload.env():
            data["offload"] = offload
        return validate(cls, data, source=f"mooncake config ({source})")


class MooncakeMasterConfig(_Strict):
    """Flags of the ``mooncake_master`` kvray runs itself (embedded default)."""

    eviction_high_watermark_ratio: float = Field(0.9, gt=0, le=1)
    """Start evicting when this fraction of the pool is used."""
    eviction_ratio: float = Field(0.05, gt=0, le=1)
    """Fraction of objects evicted per eviction round."""
    default_kv_lease_ttl_ms: int = Field(5000, ge=1)
    """Read lease granted by get/exists: the pin that keeps a lookup hit loadable."""
    client_ttl_s: int = Field(10, ge=1)
    """Seconds a silent client's segment stays mounted before the master drops it."""
    enable_offload: bool = False
    """``--enable_offload``: let clients offload to SSD (set for you when
    ``mooncake.enable_ssd_offload`` is on)."""
    extra_args: ExtraArgs = ()
    """Further ``--flag=value`` arguments passed through verbatim."""


def _env_flag(env: Mapping[str, str], var: str) -> bool | None:
    """``1``/``0`` (or ``true``/``false``) as deployments write them; unset -> None."""
    if var not in env:
        return None
    value = env[var].strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{var} must be 1 or 0 (true/false), got {env[var]!r}")


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


def _url(scheme: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, str):
            head, sep, rest = value.partition("://")
            if not sep or head not in scheme:
                raise ValueError(
                    f"expected {scheme[0]}://host:port (e.g. '{scheme[0]}://127.0.0.1:5000'), "
                    f"got {value!r}"
                )
            parse_host_port(rest, field="value")
        return value

    return check


def _mmc_size(value: Any) -> Any:
    # MemCache's files also write "2048K" and "200m"; elsewhere a bare "10G" stays an error.
    if isinstance(value, str):
        v = value.strip()
        if v[-1:].lower() in ("k", "m", "g", "t") and v[:-1].replace(".", "", 1).isdigit():
            v += "B"
        return parse_size(v, field="value")
    return _size(value)


MmcSize = Annotated[int, BeforeValidator(_mmc_size), Field(ge=0)]
TcpUrl = Annotated[str, BeforeValidator(_url(("tcp",)))]
HttpUrl = Annotated[str, BeforeValidator(_url(("http", "https")))]
LogLevel = Literal["debug", "info", "warn", "error"]


def detect_mmc_protocol(dev_root: Path = Path("/dev")) -> MmcProtocol:
    """``device_rdma`` where Ascend NPUs exist, else ``host_tcp`` (needs no RDMA NIC)."""
    return "device_rdma" if any(dev_root.glob("davinci[0-9]*")) else "host_tcp"


def _typed_items(keys: Mapping[str, str], items: Mapping[str, str]) -> dict[str, Any]:
    """Conf items -> model data: typed keys to their fields, the rest under ``extra``."""
    reverse = {key: f for f, key in keys.items()}
    data: dict[str, Any] = {"extra": {}}
    for key, value in items.items():
        if key in reverse:
            data[reverse[key]] = value
        else:
            data["extra"][key] = value
    return data


def _known_extra(v: dict[str, str], typed: dict[str, str]) -> dict[str, str]:
    from kvray.mmc_conf import KNOWN_KEYS

    for key in v:
        if key not in KNOWN_KEYS:
            raise ValueError(f"unknown MemCache key {key!r}")
        if key in typed.values():
            field = next(f for f, k in typed.items() if k == key)
            raise ValueError(f"{key} is a typed field here: set {field!r} instead")
    return v


class _MmcConf(_Strict):
    """A MemCache ``key = value`` file as a model: typed keys map to fields (``_KEYS``),
    every other known key rides in ``extra``."""

    _KEYS: ClassVar[dict[str, str]] = {}
    _ENV: ClassVar[str] = ""
    extra: dict[str, str] = Field(default_factory=dict)
    """Other ``ock.mmc.*`` keys of the file, passed through."""

    @field_validator("extra")
    @classmethod
    def _extra(cls, v: dict[str, str]) -> dict[str, str]:
        return _known_extra(v, cls._KEYS)

    def to_conf(self) -> dict[str, str]:
        """The file's items (sizes as bytes, which MemCache accepts)."""
        out = {key: str(getattr(self, f)) for f, key in self._KEYS.items()}
        return {k: v for k, v in out.items() if v != "None"} | self.extra

    @classmethod
    def from_conf(cls, items: Mapping[str, str], *, source: str) -> Self:
        return validate(cls, _typed_items(cls._KEYS, items), source=source)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """The file the environment variable names; unset: the defaults."""
        from kvray.mmc_conf import read_conf

        env = os.environ if environ is None else environ
        path = env.get(cls._ENV)
        if path is None:
            return cls()
        return cls.from_conf(read_conf(path, cls._ENV), source=path)


class MemcacheConfig(_MmcConf):
    """The MemCache client of each rank, as ``mmc-local.conf`` describes it
    (``MMC_LOCAL_CONFIG_PATH``; :meth:`from_env`)."""

    meta_service_url: TcpUrl | None = None
    """``ock.mmc.meta_service_url``: the MetaService. Unset: kvray starts one itself."""
    config_store_url: TcpUrl | None = None
    """``ock.mmc.local_service.config_store_url``; must equal the MetaService's. Unset
    with an embedded MetaService: kvray fills it in."""
    protocol: MmcProtocol = Field(default_factory=detect_mmc_protocol)
    """``ock.mmc.local_service.protocol``; default by hardware."""
    world_size: int = Field(256, ge=1, le=65536)
    """``ock.mmc.local_service.world_size``: most ranks that may connect."""
    dram_size: MmcSize = GiB
    """``ock.mmc.local_service.dram.size``: host memory this rank contributes."""
    hbm_size: MmcSize = 0
    """``ock.mmc.local_service.hbm.size``: device memory this rank contributes."""
    log_level: LogLevel = "info"
    """``ock.mmc.log_level``."""
    device_id: int = Field(0, ge=0)
    """Device passed to ``init``; with NPUs each rank's actor passes its own NPU."""
    region: Literal["host", "device"] = "host"
    """Where the rank's transfer regions live: host memory (``direct`` 3 put / 2 get) or
    NPU memory (``direct`` 0 put / 1 get)."""
    lease_ttl_ms: int = Field(5000, ge=0, le=3_600_000)
    """Lease the lookup client puts on the hits it finds (pins them until loaded)."""
    _ENV: ClassVar[str] = "MMC_LOCAL_CONFIG_PATH"
    _KEYS: ClassVar[dict[str, str]] = {
        "meta_service_url": "ock.mmc.meta_service_url",
        "config_store_url": "ock.mmc.local_service.config_store_url",
        "protocol": "ock.mmc.local_service.protocol",
        "world_size": "ock.mmc.local_service.world_size",
        "dram_size": "ock.mmc.local_service.dram.size",
        "hbm_size": "ock.mmc.local_service.hbm.size",
        "log_level": "ock.mmc.log_level",
    }

    @field_validator("dram_size", "hbm_size")
    @classmethod
    def _max(cls, v: int) -> int:
        if v > TiB:
            raise ValueError(f"MemCache accepts at most 1TB, got {v} bytes")
        return v

    @model_validator(mode="after")
    def _some_memory(self) -> MemcacheConfig:
        if self.dram_size == 0 and self.hbm_size == 0:
            raise ValueError("dram_size and hbm_size cannot both be 0 (MemCache refuses it)")
        if self.meta_service_url is not None and self.config_store_url is None:
            raise ValueError(
                "config_store_url is required with an external meta_service_url "
                "(ock.mmc.local_service.config_store_url, the MetaService's config store)"
            )
        return self


class MemcacheMetaConfig(_MmcConf):
    """The MemCache MetaService kvray runs itself (``mmc-meta.conf``; read from
    ``MMC_META_CONFIG_PATH`` when set). Unset URLs get free loopback ports."""

    meta_service_url: TcpUrl | None = None
    """``ock.mmc.meta_service_url``."""
    config_store_url: TcpUrl | None = None
    """``ock.mmc.meta_service.config_store_url``."""
    metrics_url: HttpUrl | None = None
    """``ock.mmc.meta_service.metrics_url``: ``/metrics`` and ``/health`` (default port
    8000 in MemCache: kvray always sets it)."""
    log_level: LogLevel = "info"
    """``ock.mmc.log_level``."""
    evict_threshold_high: int = Field(90, ge=1, le=100)
    """``ock.mmc.evict_threshold_high``: start evicting at this % of the pool."""
    evict_threshold_low: int = Field(80, ge=1, le=100)
    """``ock.mmc.evict_threshold_low``: evict down to this %."""
    lease_ttl_ms: int = Field(10000, ge=1)
    """``ock.mmc.meta.lease_ttl_ms``."""
    ready_timeout_s: float = Field(30.0, gt=0)
    """How long the MetaService may take to answer ``/health``."""
    _ENV: ClassVar[str] = "MMC_META_CONFIG_PATH"
    _KEYS: ClassVar[dict[str, str]] = {
        "meta_service_url": "ock.mmc.meta_service_url",
        "config_store_url": "ock.mmc.meta_service.config_store_url",
        "metrics_url": "ock.mmc.meta_service.metrics_url",
        "log_level": "ock.mmc.log_level",
        "evict_threshold_high": "ock.mmc.evict_threshold_high",
        "evict_threshold_low": "ock.mmc.evict_threshold_low",
        "lease_ttl_ms": "ock.mmc.meta.lease_ttl_ms",
    }

    @model_validator(mode="after")
    def _thresholds(self) -> MemcacheMetaConfig:
        if self.evict_threshold_low >= self.evict_threshold_high:
            raise ValueError(
                f"evict_threshold_low ({self.evict_threshold_low}) must be below "
                f"evict_threshold_high ({self.evict_threshold_high})"
            )
        return self


class SsdConfig(_Strict):
    """kvray's SSD tier: per rank, blocks as checksummed files under ``<path>/rank_<N>/``."""

    path: str
    """Directory on the SSD (absolute, existing, writable, no symlinks or ``..``; checked
    on the node that writes it)."""
    quota: ByteSize = 64 * GiB
    """Bytes per rank (payload + headers); larger than the disk is an error."""
    eviction: Literal["none", "fifo", "lru"] = "lru"
    """When full: ``none`` reports the put as pool full, ``fifo`` drops the oldest
    written, ``lru`` the least recently read or written."""
    io_threads: int = Field(4, ge=1, le=64)
    """Blocks read or written concurrently."""
    direct_io: bool = False
    """``O_DIRECT`` for keys whose addresses and sizes are 4 KiB aligned."""
    fsync: bool = False
    """fsync each block before it becomes visible (survives power loss, slower). Without
    it a block is still whole or absent after a process crash."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        p = Path(v)
        if not p.is_absolute() or ".." in p.parts:
            raise ValueError(f"must be an absolute path without '..', got {v!r}")
        return v

    @field_validator("quota")
    @classmethod
    def _quota(cls, v: int) -> int:
        if v < MiB:
            raise ValueError(f"must be at least 1MB, got {v} bytes")
        return v


def _partition(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return value


class ConnectorConfig(_Strict):
    """``kv_connector_extra_config``: AscendStoreConnector's keys plus kvray's own.

    Existing AscendStoreConnector deployments switch by changing the connector name;
    the keys below keep their meaning.
    """

    backend: BackendName = "mooncake"
    """Storage backend of the pool; must match the pool the connector attaches to."""
    lookup_rpc_port: int = Field(0, ge=0, le=65535)
    """AscendStoreConnector's lookup socket name: there it names the ZMQ IPC socket
    between an instance's scheduler and its rank-0 worker's lookup server, distinct per
    instance on a host. kvray has no such socket (its schedulers reach their node's
    Lookup actor through Ray, which serves every instance), so the value is accepted,
    so that existing configs work, and ignored."""
    mooncake_rpc_port: int = Field(0, ge=0, le=65535)
    """AscendStoreConnector's deprecated name of ``lookup_rpc_port``: ignored alike."""
    load_async: bool = False
    """Load pool hits asynchronously (reported through ``get_finished``)."""
    consumer_is_to_put: bool = False
    """A ``kv_consumer`` also stores its blocks to the pool."""
    consumer_is_to_load: bool = False
    """A ``kv_consumer`` also loads prefix hits from the pool."""
    prefill_pp_size: int = Field(1, ge=1)
    """Pipeline-parallel size of the prefill instance a decode node stores for; given
    only ``prefill_pp_layer_partition``, its number of stages."""
    prefill_pp_layer_partition: Annotated[str | None, BeforeValidator(_partition)] = None
    """Layers per prefill PP stage, e.g. ``"30,31"``; must sum to the model's layers."""
    pool_name: str = "kvray"
    """Name of the kvray pool (its Ray actors) to use."""
    namespace: str = "kvray"
    """Ray namespace of the pool's actors."""
    ray_address: str | None = None
    """Ray cluster to join from multiprocessing-executor workers (default: ``RAY_ADDRESS``;
    neither set: a cluster ``ray start`` made on this node, else the node's embedded pool,
    started by the first engine and stopped with the last)."""
    pool_config: str | None = None
    """Pool config file (YAML or JSON, as for ``kvray up --config``) the embedded pool is
    started with, when an engine starts it (no Ray cluster configured)."""
    ucm_connectors: list[dict[str, Any]] | None = None
    """UCM's store settings (``ucm_connectors[0]``, a ``UcmPipelineStore``), read by
    :mod:`kvray.ucm` into pool and connector settings."""
    UCM_CONFIG_FILE: str | None = None
    """UCM's YAML config file (also read from the ``UCM_CONFIG_FILE`` environment
    variable) when ``ucm_connectors`` is not given here."""
    lookup_timeout_ms: float = Field(200.0, gt=0)
    """A lookup slower than this is a miss, never a stall."""
    pd_wait_ms: float = Field(5000.0, ge=0)
    """PD disaggregation, decode side: how long a request whose prefill instance reported
    N stored blocks (``kv_transfer_params``, forwarded by the proxy) waits for all N to
    be in the pool, since the prefill's last saves may still be in flight when its
    answer arrives. Other requests keep running meanwhile; after the wait, what the pool
    has is loaded and the rest recomputed. 0: never wait."""
    model_namespace: str | None = Field(None, pattern=r"^[^\s@]{1,200}$")
    """First part of every block key; default: the model directory's or id's last part.
    Engines share blocks only under the same namespace (and KV layout)."""
    kv_placement: Literal["auto", "shared", "staged"] = "auto"
    """Where the KV bytes move from and to. ``shared``: the engine's KV cache itself lives
    in shared memory (CPU engines; no copy at all). ``staged``: the KV cache lives
    anywhere (GPU, NPU, CPU); blocks are gathered into a pinned shared staging region and
    scattered back. ``auto``: shared when vLLM allocated the KV cache through the
    connector's memory pool context (CPU), else staged."""
    kv_staging_size: ByteSize | None = None
    """Staging region per worker (``staged``): bytes or ``"256MB"``. Default: room for
    two of the engine's largest steps (``max_num_batched_tokens`` worth of blocks each).
    A transfer larger than staging is split, never refused."""
    use_layerwise: bool = False
    """Layer-wise transfers (AscendStoreConnector's and UCM's key): a step's pool hits
    load group by group of layers, each group waited for only before its first layer
    runs (``wait_for_layer_load``), and a step's blocks are saved group by group as soon
    as the group's last layer has run (``save_kv_layer``). Each block is then stored as
    ``layerwise_groups`` keys per rank: engines share blocks only with engines using the
    same setting."""
    layerwise_groups: int = Field(4, ge=2, le=1024)
    """With ``use_layerwise``: layer groups per rank (at most the layers each rank holds;
    set it to the layer count for one group per layer). More groups overlap more of a
    load with compute but multiply the keys a lookup asks for and the Ray calls per
    step."""

    @field_validator("prefill_pp_layer_partition")
    @classmethod
    def _partition_format(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = [p.strip() for p in v.split(",")]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"expected comma-separated positive layer counts like '30,31', got {v!r}"
            )
        return ",".join(parts)

    @model_validator(mode="before")
    @classmethod
    def _size_from_partition(cls, data: Any) -> Any:
        """The seeds set ``prefill_pp_size`` *or* ``prefill_pp_layer_partition``."""
        if isinstance(data, dict) and "prefill_pp_size" not in data:
            raw = _partition(data.get("prefill_pp_layer_partition"))
            if isinstance(raw, str) and raw.strip():
                data = {**data, "prefill_pp_size": len(raw.split(","))}
        return data

    @model_validator(mode="after")
    def _partition_size(self) -> ConnectorConfig:
        if self.prefill_pp_layer_partition is not None:
            n = len(self.prefill_pp_layer_partition.split(","))
            if n != self.prefill_pp_size:
                raise ValueError(
                    f"prefill_pp_layer_partition has {n} stages but prefill_pp_size is "
                    f"{self.prefill_pp_size}: give one layer count per prefill PP stage"
                )
        if self.use_layerwise and self.prefill_pp_size > 1:
            raise ValueError(
                "use_layerwise cannot be combined with prefill_pp_size > 1 (blocks split by a "
                "PP prefill's stages are already one key per stage): set use_layerwise to "
                "false on this instance and its prefill"
            )
        return self

    def layer_partition(self, num_layers: int) -> list[int]:
        """Layers per prefill PP stage; default split as even as possible."""
        if self.prefill_pp_layer_partition is None:
            base, rest = divmod(num_layers, self.prefill_pp_size)
            return [base + (1 if i < rest else 0) for i in range(self.prefill_pp_size)]
        parts = [int(p) for p in self.prefill_pp_layer_partition.split(",")]
        if sum(parts) != num_layers:
            raise ConfigError(
                f"prefill_pp_layer_partition {self.prefill_pp_layer_partition!r} sums to "
                f"{sum(parts)} layers but the model has {num_layers}"
            )
        return parts


_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"


class PoolConfig(_Strict):
    """One kvray pool: its actors, ranks, backend and embedded servers."""

    name: str = Field("kvray", pattern=_NAME_PATTERN)
    """Pool name; actors are named ``<name>.<role>.<rank>``."""
    namespace: str = Field("kvray", pattern=_NAME_PATTERN)
    """Ray namespace of the pool's actors."""
    backend: BackendName = "mooncake"
    """Storage backend: ``mooncake``, ``yuanrong`` (openYuanrong datasystem) or
    ``memcache`` (Huawei MemCache; its data path needs the Ascend driver)."""
    world_size: int = Field(1, ge=1, le=4096)
    """Clients per node: one BackendClient (and SSD actor) per local device/rank ("slot"
    ``0..world_size-1``), made on a node when a worker (or a Pool API call) there first
    uses it; the starting node's are made at start. At least the most engine workers
    any node runs (8 for TP8 on 8-card nodes); each client contributes its segment."""
    mooncake: MooncakeConfig = Field(default_factory=MooncakeConfig)
    """Mooncake client settings (``mooncake.json``)."""
    master: MooncakeMasterConfig = Field(default_factory=MooncakeMasterConfig)
    """Flags of the embedded ``mooncake_master`` (used only without a master address)."""
    yuanrong: YuanrongConfig = Field(default_factory=YuanrongConfig)
    """openYuanrong datasystem client settings (``DS_*`` environment variables)."""
    datasystem: DatasystemWorkerConfig = Field(default_factory=DatasystemWorkerConfig)
    """The embedded datasystem worker (used only without a worker address)."""
    memcache: MemcacheConfig = Field(default_factory=MemcacheConfig)
    """MemCache client settings (``mmc-local.conf``)."""
    memcache_meta: MemcacheMetaConfig = Field(default_factory=MemcacheMetaConfig)
    """The embedded MemCache MetaService (used only without a meta_service_url)."""
    pipeline: str | None = None
    """Tiers, fastest first: ``"<backend>"`` (default) or ``"<backend>|ssd"`` (store to
    both, load from DRAM and fall back to SSD for misses, as UCM's ``Mooncake|Posix``)."""
    ssd: SsdConfig | None = None
    """kvray's SSD tier (needed by a pipeline with ``ssd``)."""
    cpus_per_rank: float = Field(0.1, ge=0)
    """CPU Ray reserves for each BackendClient (and SSD) actor on its node."""
    replica_num: int = Field(1, ge=1, le=16)
    """Copies of each block, in distinct segments (UCM's key; Mooncake's
    ``ReplicateConfig.replica_num``): with 2 a block survives the loss of one node's
    segment. The first copy goes to the writer's own segment."""
    io_threads: int = Field(4, ge=1, le=64)
    """Threads each BackendClient uses for the backend's blocking batch calls."""
    checksum: bool = False
    """Every block stored in the backend carries an xxh3-64 of its key and bytes (an
    8-byte trailer written with it), checked on every load before the engine may use the
    bytes: a mismatch is a failed load (recomputed), counted, and the block is removed.
    Off by default: on the 2-core test machine it costs more than 5 % of the load rate
    (README, "Block checksums"). All clients of a pool agree (the setting is the
    pool's). The SSD tier checks its own files either way; the NPU device path
    (``yuanrong.device: npu``) has no trailer."""
    transfer_window_size: ByteSize = 64 * MiB
    """Shared-memory staging window per Pool client and rank (copies of foreign tensors)."""
    call_timeout_s: float = Field(60.0, gt=0)
    """Timeout of one data-plane actor call (a whole batch)."""
    lookup_timeout_s: float = Field(5.0, gt=0)
    """Timeout of one Pool API lookup call."""
    detached: bool = True
    """Pool actors outlive the process that started them (``kvray down`` stops them)."""

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "placement_strategy" in data:
            raise ValueError(
                "placement_strategy was removed: kvray places each client on the node of the "
                "worker that uses it (no placement group); delete the key"
            )
        return data

    @model_validator(mode="after")
    def _replicas(self) -> PoolConfig:
        if self.replica_num > 1 and self.backend != "mooncake":
            raise ValueError(
                f"replica_num {self.replica_num} needs backend mooncake: the {self.backend} "
                "client kvray uses has no per-put replica count (its servers own placement); "
                "set replica_num: 1"
            )
        return self

    @model_validator(mode="after")
    def _pipeline(self) -> PoolConfig:
        if self.pipeline is None:
            return self
        tiers = [t.strip() for t in self.pipeline.split("|")]
        if tiers[0] != self.backend or tiers[1:] not in ([], ["ssd"]):
            raise ValueError(
                f"pipeline {self.pipeline!r}: write '{self.backend}' or '{self.backend}|ssd' "
                "(the pool's backend first, then optionally the ssd tier)"
            )
        if "ssd" in tiers and self.ssd is None:
            raise ValueError(f"pipeline {self.pipeline!r} needs an ssd section (ssd.path, ...)")
        return self

    @property
    def ssd_tier(self) -> bool:
        """Whether the pool chains kvray's SSD tier under its DRAM backend."""
        return self.pipeline is not None and self.pipeline.replace(" ", "").endswith("|ssd")

    @model_validator(mode="after")
    def _memcache_ranks(self) -> PoolConfig:
        if self.backend == "memcache" and self.world_size > self.memcache.world_size:
            raise ValueError(
                f"world_size {self.world_size} exceeds memcache.world_size "
                f"{self.memcache.world_size} (ock.mmc.local_service.world_size): raise it"
            )
        return self

    @property
    def embedded_server(self) -> bool:
        """Whether kvray runs the backend's server itself (no address configured)."""
        if self.backend == "memcache":
            return self.memcache.meta_service_url is None
        if self.backend == "yuanrong":
            return self.yuanrong.worker_address is None
        return self.mooncake.master_server_address is None

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], environ: Mapping[str, str] | None = None
    ) -> PoolConfig:
        """Load a pool config (JSON or YAML); without a ``mooncake`` (``yuanrong``) section
        the backend's settings come from ``MOONCAKE_CONFIG_PATH`` and the environment
        (the ``DS_*`` variables)."""
        data = (
            _read_json(str(path), "--config")
            if str(path).endswith(".json")
            else read_yaml(str(path))
        )
        return cls.from_dict(data, environ, source=str(path))

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        source: str = "pool config",
    ) -> PoolConfig:
        data = dict(data or {})
        if data.get("backend", "mooncake") == "mooncake" and "mooncake" not in data:
            data["mooncake"] = MooncakeConfig.from_env(environ)
        if data.get("backend") == "yuanrong" and "yuanrong" not in data:
            data["yuanrong"] = YuanrongConfig.from_env(environ)
        if data.get("backend") == "memcache":
            if "memcache" not in data:
                data["memcache"] = MemcacheConfig.from_env(environ)
            if "memcache_meta" not in data:
                data["memcache_meta"] = MemcacheMetaConfig.from_env(environ)
        return validate(cls, data, source=source)


def validate(model: type[_M], data: Mapping[str, Any], *, source: str) -> _M:
    """Validate ``data`` into ``model``; a failure is one :class:`ConfigError` that lists
    every bad field by its dotted path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(sorted(model.model_fields))
                msg = f"unknown field (a typo?); allowed here: {allowed}"
            lines.append(f"  {loc}: {msg}")
        raise ConfigError(f"invalid {source}:\n" + "\n".join(lines)) from None


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def read_yaml(path: str, what: str = "--config") -> dict[str, Any]:
    """A YAML file holding a mapping; errors name ``what`` (the setting that named it)."""
    import yaml  # ships with ray[default]

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {path!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path!r} must hold a mapping")
    return data
