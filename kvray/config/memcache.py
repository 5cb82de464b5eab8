"""Huawei MemCache: the client of each rank (``mmc-local.conf``) and the MetaService
kvray runs itself (``mmc-meta.conf``), each a ``key = value`` file as a model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BeforeValidator, Field, field_validator, model_validator

from kvray.config._common import GiB, TiB, _size, _Strict, _url, validate
from kvray.sizes import parse_size

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
    from kvray.config.mmc_conf import KNOWN_KEYS

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
        from kvray.config.mmc_conf import read_conf

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
