"""Typed configuration, validated at load time.

Every model is ``extra="forbid"`` so that a typo fails when the config is read, not an
hour into serving; the error names the dotted field and the fields allowed there. One
module per concern:

- :mod:`~kvray.config.pool`: :class:`PoolConfig`, one pool: its name, ranks, backend
  sections, tiers (:class:`Pipeline`) and embedded servers; one subclass per backend
  (:class:`MooncakePoolConfig`, ...) holds only that backend's sections.
- :mod:`~kvray.config.connector`: :class:`ConnectorConfig`, the
  ``kv_connector_extra_config`` keys, the same as AscendStoreConnector's, plus kvray's own.
- :mod:`~kvray.config.mooncake`: :class:`MooncakeConfig`, the Mooncake client, loaded
  from ``mooncake.json`` (the file ``MOONCAKE_CONFIG_PATH`` names) exactly as
  vLLM-Ascend deployments write it, and the embedded ``mooncake_master``.
- :mod:`~kvray.config.yuanrong`: :class:`YuanrongConfig` (openYuanrong datasystem, from
  the ``DS_*`` variables) and the embedded datasystem worker.
- :mod:`~kvray.config.memcache`: MemCache's client and MetaService ``.conf`` files.
- :mod:`~kvray.config.ssd`: kvray's SSD tier.
- :mod:`~kvray.config.kv_events`: the pool's KV-events publisher.
- :mod:`~kvray.config._common`: the strict base, shared field types, :func:`validate`
  and the file readers.

The environment is read once, at the edge (the ``from_env`` methods), never at import
time.
"""

from kvray.config._common import (
    BackendName,
    ByteSize,
    ExtraArgs,
    GiB,
    HostPort,
    MiB,
    TiB,
    parse_host_port,
    read_yaml,
    validate,
)
from kvray.config.connector import ConnectorConfig
from kvray.config.kv_events import KVEventsConfig
from kvray.config.memcache import (
    HttpUrl,
    LogLevel,
    MemcacheConfig,
    MemcacheMetaConfig,
    MmcProtocol,
    MmcSize,
    TcpUrl,
    detect_mmc_protocol,
)
from kvray.config.mooncake import (
    MooncakeConfig,
    MooncakeMasterConfig,
    MooncakeOffloadConfig,
    Protocol,
    detect_protocol,
)
from kvray.config.pool import (
    POOL_CONFIGS,
    MemcachePoolConfig,
    MooncakePoolConfig,
    Pipeline,
    PoolConfig,
    YuanrongPoolConfig,
    as_backend,
)
from kvray.config.ssd import SsdConfig
from kvray.config.yuanrong import DatasystemWorkerConfig, YuanrongConfig

__all__ = [
    "POOL_CONFIGS",
    "BackendName",
    "ByteSize",
    "ConnectorConfig",
    "DatasystemWorkerConfig",
    "KVEventsConfig",
    "ExtraArgs",
    "GiB",
    "HostPort",
    "HttpUrl",
    "LogLevel",
    "MemcacheConfig",
    "MemcacheMetaConfig",
    "MemcachePoolConfig",
    "MiB",
    "MmcProtocol",
    "MmcSize",
    "MooncakeConfig",
    "MooncakeMasterConfig",
    "MooncakeOffloadConfig",
    "MooncakePoolConfig",
    "Pipeline",
    "PoolConfig",
    "Protocol",
    "SsdConfig",
    "TcpUrl",
    "TiB",
    "YuanrongConfig",
    "YuanrongPoolConfig",
    "as_backend",
    "detect_mmc_protocol",
    "detect_protocol",
    "parse_host_port",
    "read_yaml",
    "validate",
]
