"""MemCache's ``key = value`` config files (``mmc-meta.conf``, ``mmc-local.conf``): read,
check against the keys the 1.3.0 binaries know, and write.

The key list below is every ``ock.mmc.*`` (and ``ubsio.*``) key found in
``libmf_memcache.so`` of memcache-hybrid 1.3.0; a key outside it is a typo that MemCache
would reject at start ("Wrong configuration in file ..."), so kvray rejects it at load
time, naming the file and line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvray.errors import ConfigError

_CLIENT = (
    "aggregate.io aggregate.num batch_option.chunk.count batch_option.chunk.size "
    "read_thread_pool.size retry_milliseconds timeout.seconds write_thread_pool.size"
)
_TLS = "ca.crl.path ca.path cert.path decrypter.path enable key.pass.path key.path package.path"
_HCOM_TLS = "ca.crl.path ca.path cert.path decrypter.path enable key.pass.path key.path"
_LOCAL = (
    "backend_id config_store_url config_store_url_domain dram.best_effort.enabled dram.size "
    "hbm.size hcom_url max.dram.size max.hbm.size protocol storage.enabled tag tag_op_info "
    "world_size"
)
_META = (
    "alloc.max_value_mode.enabled config_store_url lru_shard_count lru_type "
    "metrics_report_interval_seconds metrics_url storage.metadata_mode"
)
_TOP = (
    "defrag_evict_threshold dynamic_config.enable dynamic_config.interval "
    "evict_check_interval_seconds evict_threshold_high evict_threshold_low "
    "evict_yield_duration_us evict_yield_interval log_level log_output_target log_path "
    "log_rotation_file_count log_rotation_file_size meta.ha.enable meta.lease_ttl_ms "
    "meta_service_url"
)
_KV_EVENTS = "block_size enable endpoint hash_as_int model_name queue_capacity tenant_id transport"
_STORAGE = "async_flush.batch_limit async_flush.interval_ms pending_wait.timeout prefetch.enabled"

KNOWN_KEYS: frozenset[str] = frozenset(
    [f"ock.mmc.client.{k}" for k in _CLIENT.split()]
    + [f"ock.mmc.config_store.tls.{k}" for k in _TLS.split()]
    + [f"ock.mmc.metrics.tls.{k}" for k in _TLS.split()]
    + [f"ock.mmc.tls.{k}" for k in _TLS.split()]
    + [f"ock.mmc.local_service.hcom.tls.{k}" for k in _HCOM_TLS.split()]
    + [f"ock.mmc.local_service.{k}" for k in _LOCAL.split()]
    + [f"ock.mmc.meta_service.{k}" for k in _META.split()]
    + [f"ock.mmc.kv_events.{k}" for k in _KV_EVENTS.split()]
    + [f"ock.mmc.storage.{k}" for k in _STORAGE.split()]
    + [f"ock.mmc.zmq.{k}" for k in ("enable_curve", "private_key", "public_key")]
    + [f"ock.mmc.{k}" for k in _TOP.split()]
    + ["ubsio.disk.path", "ubsio.mem.size_in_gb", "ubsio.standalone.device_count"]
)


def parse_conf(text: str, *, source: str) -> dict[str, str]:
    """``key = value`` lines; ``#`` starts a comment line; blank lines are skipped."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"{source}:{n}: expected 'key = value', got {raw.strip()!r}")
        if key not in KNOWN_KEYS:
            near = sorted(k for k in KNOWN_KEYS if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1])
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"{source}:{n}: unknown MemCache key {key!r}{hint}")
        if key in out:
            raise ConfigError(f"{source}:{n}: {key} is set twice")
        out[key] = value
    return out


def read_conf(path: str, variable: str) -> dict[str, str]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{variable}: cannot read {path!r}: {exc.strerror}") from exc
    return parse_conf(text, source=path)


def render_conf(items: Mapping[str, str], header: str) -> str:
    lines = [f"# {header}"]
    lines += [f"{k} = {v}" for k, v in items.items()]
    return "\n".join(lines) + "\n"
