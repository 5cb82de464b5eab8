"""UCM's configuration, read as what it means for kvray.

A UCM deployment configures its store in ``kv_connector_extra_config.ucm_connectors``
or in the YAML file ``UCM_CONFIG_FILE`` names (the environment variable, or the key of
that name in ``kv_connector_extra_config``). kvray reads the first connector's
``UcmPipelineStore`` config (as UCM does) and turns it into pool settings (the embedded
pool is started with them; a running pool configured otherwise is reported at attach)
and connector settings. Each UCM key is taken with its meaning, refused naming kvray's
equivalent, or (UCM tuning of parts kvray does not have) ignored and listed in one log
line: :data:`KEYS` says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvray.config import GiB, Pipeline, read_yaml
from kvray.errors import ConfigError

PIPELINES = {
    "mooncake": Pipeline("mooncake"),
    "mooncake|posix": Pipeline("mooncake", ssd=True),
    "yuanrong": Pipeline("yuanrong"),
    "yuanrong|posix": Pipeline("yuanrong", ssd=True),
}
"""UCM ``store_pipeline`` (any case) -> kvray ``pipeline``."""

REFUSED_PIPELINES = {
    "cache|posix": "UCM's node-local host cache in front of files; kvray's pool is "
    "shared DRAM: use store_pipeline 'Mooncake|Posix' (kvray pipeline 'mooncake|ssd')",
    "cache|compress|posix": "kvray stores blocks uncompressed: use 'Mooncake|Posix'",
    "cache|ds3fs": "kvray's SSD tier writes a local or mounted directory: use "
    "'Mooncake|Posix' with storage_backends on the 3FS mount",
}

IGNORED_PREFIXES = ("cache_", "posix_gc_", "yuanrong_")
IGNORED = frozenset(
    {
        "share_buffer_enable",
        "share_buffer_capacity_gb",
        "posix_open_concurrency",
        "posix_commit_concurrency",
        "posix_lookup_concurrency",
        "store_health",
        "use_gdr",
        "waiting_queue_depth",
        "running_queue_depth",
        "local_rank_size",
        # top level
        "enable_event_sync",
        "persist_token_threshold",
        "wa_dump_block_wise",
        "load_tokens_threshold",
        "enable_record_traces",
        "enable_metrics",
        "metrics_config_path",
        "ucm_sparse_config",
    }
)
"""UCM tuning of parts kvray does not have (its host cache, GC, health probes, queues,
sparse attention, its own metrics): ignored, and listed at attach."""

KEYS = {
    "store_pipeline": "pipeline (Mooncake -> mooncake, Mooncake|Posix -> mooncake|ssd, "
    "YuanRong -> yuanrong, YuanRong|Posix -> yuanrong|ssd)",
    "storage_backends": "ssd.path (one directory per node)",
    "posix_capacity_gb": "ssd.quota (GiB per rank)",
    "io_direct": "ssd.direct_io",
    "posix_io_engine": "psync only (kvray's SSD tier does synchronous I/O on threads)",
    "posix_data_trans_concurrency": "ssd.io_threads (at most 64)",
    "stream_number": "io_threads (at most 64)",
    "timeout_ms": "call_timeout_s",
    "master_server_address": "mooncake.master_server_address",
    "local_hostname": "mooncake.local_hostname",
    "metadata_server": "mooncake.metadata_server",
    "protocol": "mooncake.protocol",
    "device_name": "mooncake.device_name",
    "global_segment_size_gb": "mooncake.global_segment_size (GiB)",
    "local_buffer_size_gb": "mooncake.local_buffer_size (GiB)",
    "replica_num": "replica_num",
    "yuanrong_host": "yuanrong.worker_address (with yuanrong_port)",
    "yuanrong_port": "yuanrong.worker_address (with yuanrong_host)",
    "yuanrong_timeout_ms": "yuanrong.request_timeout_ms",
    "use_layerwise": "the connector's use_layerwise",
}


@dataclass
class UcmSettings:
    source: str
    pool: dict[str, Any] = field(default_factory=dict)
    """Pool config overrides (nested sections as dicts)."""
    connector: dict[str, Any] = field(default_factory=dict)
    """Connector config overrides."""
    ignored: list[str] = field(default_factory=list)


def settings(extra: Mapping[str, Any], environ: Mapping[str, str]) -> UcmSettings | None:
    """The UCM config in ``extra`` (``kv_connector_extra_config``) or the file
    ``UCM_CONFIG_FILE`` names; None when there is none."""
    top: Mapping[str, Any] = extra
    connectors = extra.get("ucm_connectors")
    source = "kv_connector_extra_config.ucm_connectors"
    path = extra.get("UCM_CONFIG_FILE") or environ.get("UCM_CONFIG_FILE")
    if connectors is None and path:
        top = read_yaml(str(path), "UCM_CONFIG_FILE")
        connectors = top.get("ucm_connectors")
        source = f"UCM_CONFIG_FILE {path}"
        if connectors is None:
            raise ConfigError(f"{source}: no ucm_connectors list (UCM's store settings)")
    if connectors is None:
        return None
    if not isinstance(connectors, list) or not connectors or not isinstance(connectors[0], dict):
        raise ConfigError(f"{source}: ucm_connectors must be a list of connector mappings")
    first = connectors[0]
    name = first.get("ucm_connector_name")
    if name != "UcmPipelineStore":
        raise ConfigError(
            f"{source}: ucm_connector_name {name!r}: kvray reads UcmPipelineStore configs "
            "(store_pipeline 'Mooncake' or 'Mooncake|Posix'); for files alone use kvray's "
            "SSD tier behind a backend (pipeline 'mooncake|ssd', ssd.path)"
        )
    conf = dict(first.get("ucm_connector_config") or {})
    out = UcmSettings(source)
    _connector_keys(conf, out)
    for key in ("use_layerwise", "use_lite", *IGNORED):
        if key in top and top is not extra:
            _top_key(key, top[key], out)
    return out


def _connector_keys(conf: dict[str, Any], out: UcmSettings) -> None:
    src = out.source
    pool = out.pool
    mooncake: dict[str, Any] = {}
    ssd: dict[str, Any] = {}
    yuanrong: dict[str, Any] = {}
    raw = str(conf.pop("store_pipeline", "")).strip()
    if not raw:
        raise ConfigError(f"{src}: store_pipeline is required ('Mooncake' or 'Mooncake|Posix')")
    pipeline = PIPELINES.get(raw.lower())
    if pipeline is None:
        why = REFUSED_PIPELINES.get(raw.lower(), "not a kvray pipeline")
        raise ConfigError(
            f"{src}: store_pipeline {raw!r}: {why} (kvray takes: {', '.join(PIPELINES)})"
        )
    pool["backend"] = pipeline.backend
    pool["pipeline"] = str(pipeline)
    host = conf.pop("yuanrong_host", None)
    port = conf.pop("yuanrong_port", None)
    if (host is None) != (port is None):
        raise ConfigError(f"{src}: set yuanrong_host and yuanrong_port together")
    if host is not None:
        yuanrong["worker_address"] = f"{host}:{port}"
    for key, value in conf.items():
        if key == "storage_backends":
            dirs = [d for d in str(value).split(":") if d]
            if len(dirs) != 1:
                raise ConfigError(
                    f"{src}: storage_backends {value!r}: kvray's SSD tier writes one "
                    "directory per node (ssd.path); give one mount point"
                )
            ssd["path"] = dirs[0]
        elif key == "posix_capacity_gb":
            if int(value) > 0:  # UCM's 0: no capacity limit (GC off)
                ssd["quota"] = int(value) * GiB
        elif key == "io_direct":
            ssd["direct_io"] = bool(value)
        elif key == "posix_io_engine":
            if str(value).lower() != "psync":
                raise ConfigError(
                    f"{src}: posix_io_engine {value!r}: kvray's SSD tier does synchronous "
                    "I/O on ssd.io_threads threads (UCM's psync); remove it or set 'psync'"
                )
        elif key == "posix_data_trans_concurrency":
            ssd["io_threads"] = _threads(value, key, out)
        elif key == "stream_number":
            pool["io_threads"] = _threads(value, key, out)
        elif key == "timeout_ms":
            pool["call_timeout_s"] = float(value) / 1e3
        elif key in ("master_server_address", "local_hostname", "metadata_server",
                     "protocol", "device_name"):  # fmt: skip
            mooncake[key] = value
        elif key == "global_segment_size_gb":
            mooncake["global_segment_size"] = int(value) * GiB
        elif key == "local_buffer_size_gb":
            mooncake["local_buffer_size"] = int(value) * GiB
        elif key == "replica_num":
            pool["replica_num"] = int(value)
        elif key == "yuanrong_timeout_ms":
            yuanrong["request_timeout_ms"] = int(value)
        elif key in IGNORED or key.startswith(IGNORED_PREFIXES):
            out.ignored.append(key)
        else:
            raise ConfigError(
                f"{src}: ucm_connector_config.{key} is not a UCM key kvray knows (a typo?); "
                f"kvray reads: {', '.join(KEYS)}"
            )
    if pipeline.ssd and "path" not in ssd:
        raise ConfigError(f"{src}: store_pipeline {raw!r} needs storage_backends (ssd.path)")
    if pipeline.backend == "yuanrong" and mooncake:
        raise ConfigError(
            f"{src}: store_pipeline {raw!r} with Mooncake keys ({', '.join(mooncake)}): "
            "drop them or use store_pipeline 'Mooncake|Posix'"
        )
    if pipeline.backend == "mooncake" and yuanrong:
        raise ConfigError(
            f"{src}: store_pipeline {raw!r} with YuanRong keys ({', '.join(yuanrong)}): "
            "drop them or use store_pipeline 'YuanRong'"
        )
    for name, section in (("mooncake", mooncake), ("ssd", ssd), ("yuanrong", yuanrong)):
        if section:
            pool[name] = section


def _threads(value: Any, key: str, out: UcmSettings) -> int:
    n = int(value)
    if n < 1:
        raise ConfigError(f"{out.source}: {key} must be >= 1, got {value!r}")
    if n > 64:
        out.ignored.append(f"{key} above 64 (kvray uses 64)")
    return min(n, 64)


def _top_key(key: str, value: Any, out: UcmSettings) -> None:
    if key == "use_layerwise":
        out.connector["use_layerwise"] = bool(value)
    elif key == "use_lite":
        if value:
            raise ConfigError(
                f"{out.source}: use_lite true stores metadata without KV bytes; kvray always "
                "stores and loads the bytes: remove use_lite"
            )
    else:
        out.ignored.append(key)


def differences(pool: Any, overrides: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Fields of a running pool (its ``PoolConfig``, or a section of it) that UCM's
    settings set otherwise: ``field: pool X, UCM Y``."""
    out = []
    for key, want in overrides.items():
        have = getattr(pool, key, None)
        if isinstance(want, dict) and have is not None and not isinstance(have, str | int):
            out += differences(have, want, f"{prefix}{key}.")
        elif have != want and not (isinstance(have, str) and str(want).lower() == have):
            out.append(f"{prefix}{key}: pool {have!r}, UCM {want!r}")
    return out
