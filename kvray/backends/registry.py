"""One :class:`BackendSpec` per storage backend: everything kvray does differently by
backend, asked here instead of branching on the backend's name.

The launcher, the pool manager, ``kvray status`` / ``up`` / ``doctor`` and the engine's
environment checks all read the spec of ``PoolConfig.backend``. Adding a backend means
its adapter (``kvray/backends/<name>.py``), its embedded server
(``kvray/servers/<name>.py``), its config section, and one row in :data:`SPECS`.

Everything that loads a native library (a backend's client module) or talks to Ray is
imported or done by the caller, not here: a row's functions import lazily, so a process
only loads the backend it uses.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, get_args

from kvray.backends.checks import mooncake_checks, yuanrong_checks
from kvray.config import (
    BackendName,
    MemcachePoolConfig,
    MooncakePoolConfig,
    PoolConfig,
    YuanrongPoolConfig,
    as_backend,
)
from kvray.servers.datasystem import DatasystemWorker
from kvray.servers.mmc_meta import MetaService
from kvray.servers.mooncake_master import MooncakeMaster
from kvray.servers.process import ServerProcess

if TYPE_CHECKING:
    from kvray.backends.base import Backend
    from kvray.findings import Finding, Host

DoctorChecks = Callable[[PoolConfig, Mapping[str, str], "Host"], "list[Finding]"]


def _mc(config: PoolConfig) -> MooncakePoolConfig:
    return as_backend(config, MooncakePoolConfig)


def _yr(config: PoolConfig) -> YuanrongPoolConfig:
    return as_backend(config, YuanrongPoolConfig)


def _mmc(config: PoolConfig) -> MemcachePoolConfig:
    return as_backend(config, MemcachePoolConfig)


def _no_checks(cfg: PoolConfig, env: Mapping[str, str], host: Host) -> list[Finding]:
    return []


def _never(config: PoolConfig) -> bool:
    return False


def _same(config: PoolConfig, node_ip: str) -> PoolConfig:
    return config


def _same_rank(config: PoolConfig, rank: int) -> PoolConfig:
    return config


def _host_memory(config: PoolConfig) -> DeviceSetting | None:
    return None


@dataclass(frozen=True)
class DeviceSetting:
    """The setting that makes a backend's clients move device memory."""

    field: str
    """Its dotted config field (``yuanrong.device``)."""
    value: str
    """The value it has (``npu``)."""
    host_value: str
    """The value for host memory, the fix where device memory cannot be served."""


@dataclass(frozen=True)
class BackendSpec:
    """What kvray needs to know of one backend."""

    name: BackendName
    server_name: str
    """Its server as logs, ``kvray up`` and ``kvray status`` name it (``embedded X``)."""
    client_section: str
    """The ``PoolConfig`` section of its clients' settings."""
    env_sections: tuple[str, ...]
    """The sections ``PoolConfig.from_dict`` builds from :attr:`config_vars` when the
    config has none."""
    config_vars: tuple[str, ...]
    """The environment variables those sections come from (an engine whose environment
    would make them otherwise than the running pool's is told at attach; never forwarded
    to the pool's actors)."""
    make_client: Callable[[PoolConfig, str, bool], Backend]
    """``(config, server_address, contribute_memory)``: a new client."""
    make_server: Callable[[PoolConfig, str], ServerProcess]
    """``(config, host)``: the embedded server for ``config``, to listen on ``host``
    (``PoolConfig.listen_host``; not started)."""
    reachability: Callable[[PoolConfig], list[tuple[str, str]]]
    """``(field, host:port)`` of every external server the config names."""
    forward_prefixes: tuple[str, ...] = ()
    """Prefixes of its client's native knobs in an engine's environment, which the pool's
    actors run with (:func:`kvray.engine_env.forwarded`)."""
    client_env_defaults: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """kvray's values for those knobs in the pool's actors (the engine's override them)."""
    client_env: Callable[[PoolConfig], dict[str, str]] = lambda config: {}
    """Knobs the pool config sets for the actors (they override the engine's)."""
    device_setting: Callable[[PoolConfig], DeviceSetting | None] = _host_memory
    """Set when its clients move device memory (no checksum trailers, no host shared
    memory): the setting that makes them."""
    for_rank: Callable[[PoolConfig, int], PoolConfig] = _same_rank
    """``(config, slot)``: the config the client of that slot runs with."""
    on_node: Callable[[PoolConfig, str], PoolConfig] = _same
    """``(config, node_ip)``: the config a client on that node runs with."""
    per_node_server: Callable[[PoolConfig], bool] = _never
    """Each node's clients connect to a server of their own node (``on_node`` raises
    ConfigError for a node without one)."""
    node_local_fix: str | None = None
    """Set when its embedded server serves its own node's clients only: the fix for
    engines on other nodes."""
    node_cleanup: Callable[[], object] | None = None
    """Removes what killed clients leave on a node (run after a pool's teardown)."""
    doctor_checks: DoctorChecks = _no_checks
    """Its traps, for ``kvray doctor`` (:func:`kvray.doctor.check_pool`)."""


def with_client_settings(config: PoolConfig, settings: Mapping[str, Any]) -> PoolConfig:
    """``config`` with ``settings`` (what its embedded server chose,
    :meth:`ServerProcess.client_settings`) in its backend's client section."""
    if not settings:
        return config
    section = spec_of(config.backend).client_section
    updated = getattr(config, section).model_copy(update=dict(settings))
    return config.model_copy(update={section: updated})


# ---- mooncake -------------------------------------------------------------------------


def _mooncake_client(config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
    from kvray.backends.mooncake import MooncakeBackend

    config = _mc(config)
    return MooncakeBackend(
        config.mooncake,
        address,
        io_threads=config.io_threads,
        contribute_memory=contribute_memory,
        replica_num=config.replica_num,
    )


def _mooncake_for_rank(config: PoolConfig, rank: int) -> PoolConfig:
    mc = _mc(config).mooncake
    if not mc.enable_client_http_server:
        return config
    # One client HTTP port per client of the node.
    mooncake = mc.model_copy(update={"client_http_port": mc.client_http_port + rank})
    return config.model_copy(update={"mooncake": mooncake})


def _mooncake_master(pool: PoolConfig, host: str) -> MooncakeMaster:
    config = _mc(pool)
    log_dir = os.path.join(tempfile.gettempdir(), "kvray", config.name)
    master = config.master
    if config.mooncake.enable_ssd_offload and not master.enable_offload:
        master = master.model_copy(update={"enable_offload": True})
    return MooncakeMaster(master, log_dir, host=host)


def _mooncake_on_node(config: PoolConfig, node_ip: str) -> PoolConfig:
    # A client advertises the address Ray knows its node by.
    mc = _mc(config).mooncake
    if mc.local_hostname is not None:
        return config
    mooncake = mc.model_copy(update={"local_hostname": node_ip})
    return config.model_copy(update={"mooncake": mooncake})


def _mooncake_reachability(config: PoolConfig) -> list[tuple[str, str]]:
    address = _mc(config).mooncake.master_server_address
    return [("mooncake.master_server_address", address)] if address else []


MOONCAKE = BackendSpec(
    name="mooncake",
    server_name="mooncake_master",
    client_section="mooncake",
    env_sections=("mooncake",),
    config_vars=(
        "MOONCAKE_CONFIG_PATH",
        "MOONCAKE_MASTER",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE",
        "ASCEND_ENABLE_USE_FABRIC_MEM",
    ),
    make_client=_mooncake_client,
    make_server=_mooncake_master,
    for_rank=_mooncake_for_rank,
    reachability=_mooncake_reachability,
    # Mooncake's transfer engine and store client (MC_*), its SSD offload.
    forward_prefixes=("MC_", "MOONCAKE_OFFLOAD_"),
    # Fail a setup against an unreachable master in seconds, not ~90 s.
    client_env_defaults=MappingProxyType({"MC_STORE_CLIENT_SETUP_RETRIES": "1"}),
    client_env=lambda c: _mc(c).mooncake.offload.env(),
    on_node=_mooncake_on_node,
    doctor_checks=mooncake_checks,
)


# ---- yuanrong (openYuanrong datasystem) -----------------------------------------------


def _yuanrong_client(config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
    # A datasystem client contributes no memory either way: the worker owns it. It
    # connects to its node's worker (set by on_node), else the pool's.
    yr = _yr(config).yuanrong
    address = yr.worker_address or address
    if yr.device == "npu":
        from kvray.backends.yuanrong_npu import YuanrongDeviceBackend

        return YuanrongDeviceBackend(yr, address, io_threads=config.io_threads)
    from kvray.backends.yuanrong import YuanrongBackend

    return YuanrongBackend(yr, address, io_threads=config.io_threads)


def _yuanrong_on_node(config: PoolConfig, node_ip: str) -> PoolConfig:
    yr = _yr(config).yuanrong
    if not yr.node_worker_addresses:
        return config
    worker = yr.address_on(node_ip)  # ConfigError if that node has none
    yuanrong = yr.model_copy(update={"worker_address": worker})
    return config.model_copy(update={"yuanrong": yuanrong})


def _yuanrong_reachability(c: PoolConfig) -> list[tuple[str, str]]:
    yr = _yr(c).yuanrong
    out = [("yuanrong.worker_address", yr.worker_address)] if yr.worker_address else []
    return out + [
        (f"yuanrong.node_worker_addresses[{ip}]", a) for ip, a in yr.node_worker_addresses.items()
    ]


YUANRONG = BackendSpec(
    name="yuanrong",
    server_name="datasystem worker",
    client_section="yuanrong",
    env_sections=("yuanrong",),
    config_vars=("DS_WORKER_ADDR",),
    make_client=_yuanrong_client,
    # Loopback whatever server_host says: the worker serves its own node's shared memory.
    make_server=lambda c, host: DatasystemWorker(_yr(c).datasystem, name=c.name),
    reachability=_yuanrong_reachability,
    device_setting=lambda c: (
        DeviceSetting("yuanrong.device", "npu", "host") if _yr(c).yuanrong.device == "npu" else None
    ),
    on_node=_yuanrong_on_node,
    per_node_server=lambda c: bool(_yr(c).yuanrong.node_worker_addresses),
    node_local_fix=(
        "run a worker per node (scripts/datasystem_cluster.py) and set "
        "yuanrong.worker_address and node_worker_addresses, or keep engines on the "
        "pool's node"
    ),
    doctor_checks=yuanrong_checks,
)


# ---- memcache (Huawei MemCache) -------------------------------------------------------


def _memcache_client(config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
    # The client finds its MetaService through config.memcache (the embedded one's urls
    # are written there: ServerProcess.client_settings).
    from kvray.backends.memcache import MemcacheBackend

    return MemcacheBackend(
        _mmc(config).memcache, contribute_memory=contribute_memory, io_threads=config.io_threads
    )


def _memcache_cleanup() -> list[str]:
    from kvray.backends.memcache import remove_stale_local_confs

    return remove_stale_local_confs()


def _memcache_reachability(config: PoolConfig) -> list[tuple[str, str]]:
    url = _mmc(config).memcache.meta_service_url
    return [("memcache.meta_service_url", url.split("://", 1)[-1])] if url else []


MEMCACHE = BackendSpec(
    name="memcache",
    server_name="MemCache MetaService",
    client_section="memcache",
    env_sections=("memcache", "memcache_meta"),
    config_vars=("MMC_LOCAL_CONFIG_PATH", "MMC_META_CONFIG_PATH"),
    make_client=_memcache_client,
    make_server=lambda c, host: MetaService(_mmc(c).memcache_meta, host=host, name=c.name),
    reachability=_memcache_reachability,
    device_setting=lambda c: (
        DeviceSetting("memcache.region", "device", "host")
        if _mmc(c).memcache.region == "device"
        else None
    ),
    node_cleanup=_memcache_cleanup,
)


SPECS: Mapping[str, BackendSpec] = MappingProxyType(
    {s.name: s for s in (MOONCAKE, YUANRONG, MEMCACHE)}
)
assert set(SPECS) == set(get_args(BackendName)), "a backend without a registry row"


def spec_of(backend: str) -> BackendSpec:
    """The spec of ``backend`` (a validated ``PoolConfig.backend``)."""
    try:
        return SPECS[backend]
    except KeyError:
        raise AssertionError(f"no registry row for backend {backend!r}: kvray's bug") from None
