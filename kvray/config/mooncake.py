"""Mooncake: the client (``mooncake.json``), its native SSD offload knobs
(``MOONCAKE_OFFLOAD_*``) and the ``mooncake_master`` kvray runs itself.

Precedence (highest first): ``MOONCAKE_MASTER`` and ``MOONCAKE_GLOBAL_SEGMENT_SIZE``
environment variables, then ``mooncake.json`` (``MOONCAKE_CONFIG_PATH``), then the
defaults below.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from kvray.config._common import (
    ByteSize,
    ExtraArgs,
    GiB,
    HostPort,
    MiB,
    _lower,
    _read_json,
    _Strict,
    validate,
)
from kvray.errors import ConfigError

Protocol = Literal["tcp", "rdma", "ascend"]


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
    prefault_segment: bool = True
    """Map each storing client's segment in the background after start, paced to a tenth
    of a core, so stores copy into mapped pages instead of faulting each page in beside
    the engines' forwards (skipped, with a warning, when the segment does not fit in 90 %
    of the host's available memory; stopped, with a warning, when the host's available
    memory falls below a fifth of its total). False: Mooncake's own behaviour, pages
    mapped as stores first write them."""
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
