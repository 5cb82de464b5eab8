"""One :class:`BackendSpec` per storage backend: everything kvray does differently by
backend, asked here instead of branching on the backend's name.

The launcher, the pool manager, ``kvray status`` / ``up`` / ``doctor`` and the engine's
environment checks all read the spec of ``PoolConfig.backend``. Adding a backend means
its adapter (``kvray/backends/<name>.py``), its embedded server
(``kvray/servers/<name>.py``), its config section, and one subclass here, in
:data:`SPECS`.

Everything that loads a native library (a backend's client module) or talks to Ray is
imported or done by the caller, not here: a spec's methods import lazily, so a process
only loads the backend it uses.
"""

from __future__ import annotations

import abc
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, get_args

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


@dataclass(frozen=True)
class DeviceSetting:
    """The setting that makes a backend's clients move device memory."""

    field: str
    """Its dotted config field (``yuanrong.device``)."""
    value: str
    """The value it has (``npu``)."""
    host_value: str
    """The value for host memory, the fix where device memory cannot be served."""


class BackendSpec(abc.ABC):
    """What kvray needs to know of one backend. The defaults fit a backend without the
    feature; each method is given the pool's whole config (its backend's union member)."""

    name: ClassVar[BackendName]
    server_name: ClassVar[str]
    """Its server as logs, ``kvray up`` and ``kvray status`` name it (``embedded X``)."""
    client_section: ClassVar[str]
    """The ``PoolConfig`` section of its clients' settings."""
    env_sections: ClassVar[tuple[str, ...]]
    """The sections ``PoolConfig.from_dict`` builds from :attr:`config_vars` when the
    config has none."""
    config_vars: ClassVar[tuple[str, ...]]
    """The environment variables those sections come from (an engine whose environment
    would make them otherwise than the running pool's is told at attach; never forwarded
    to the pool's actors)."""
    forward_prefixes: ClassVar[tuple[str, ...]] = ()
    """Prefixes of its client's native knobs in an engine's environment, which the pool's
    actors run with (:func:`kvray.engine_env.forwarded`)."""
    client_env_defaults: ClassVar[Mapping[str, str]] = MappingProxyType({})
    """kvray's values for those knobs in the pool's actors (the engine's override them)."""
    node_local_fix: ClassVar[str | None] = None
    """Set when its embedded server serves its own node's clients only: the fix for
    engines on other nodes."""

    @abc.abstractmethod
    def make_client(self, config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
        """A new client of the server at ``address``."""

    @abc.abstractmethod
    def make_server(self, config: PoolConfig, host: str) -> ServerProcess:
        """The embedded server for ``config``, to listen on ``host``
        (``PoolConfig.listen_host``; not started)."""

    def reachability(self, config: PoolConfig) -> list[tuple[str, str]]:
        """``(field, host:port)`` of every external server the config names."""
        return []

    def client_env(self, config: PoolConfig) -> dict[str, str]:
        """Knobs the pool config sets for the actors (they override the engine's)."""
        return {}

    def device_setting(self, config: PoolConfig) -> DeviceSetting | None:
        """Set when its clients move device memory (no checksum trailers, no host shared
        memory): the setting that makes them."""
        return None

    def for_rank(self, config: PoolConfig, rank: int) -> PoolConfig:
        """The config the client of slot ``rank`` runs with."""
        return config

    def on_node(self, config: PoolConfig, node_ip: str) -> PoolConfig:
        """The config a client on the node Ray knows as ``node_ip`` runs with."""
        return config

    def per_node_server(self, config: PoolConfig) -> bool:
        """Each node's clients connect to a server of their own node (:meth:`on_node`
        raises ConfigError for a node without one)."""
        return False

    def doctor_checks(
        self, config: PoolConfig, env: Mapping[str, str], host: Host
    ) -> list[Finding]:
        """Its traps, for ``kvray doctor`` (:func:`kvray.doctor.check_pool`)."""
        return []

    def node_cleanup(self) -> None:
        """Remove what killed clients leave on this node (after a pool's teardown)."""
        return None


def with_client_settings(config: PoolConfig, settings: Mapping[str, Any]) -> PoolConfig:
    """``config`` with ``settings`` (what its embedded server chose,
    :meth:`ServerProcess.client_settings`) in its backend's client section."""
    if not settings:
        return config
    section = spec_of(config.backend).client_section
    updated = getattr(config, section).model_copy(update=dict(settings))
    return config.model_copy(update={section: updated})


class Mooncake(BackendSpec):
    name = "mooncake"
    server_name = "mooncake_master"
    client_section = "mooncake"
    env_sections = ("mooncake",)
    config_vars = (
        "MOONCAKE_CONFIG_PATH",
        "MOONCAKE_MASTER",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE",
        "ASCEND_ENABLE_USE_FABRIC_MEM",
    )
    # Mooncake's transfer engine and store client (MC_*), its SSD offload.
    forward_prefixes = ("MC_", "MOONCAKE_OFFLOAD_")
    # Fail a setup against an unreachable master in seconds, not ~90 s.
    client_env_defaults = MappingProxyType({"MC_STORE_CLIENT_SETUP_RETRIES": "1"})

    def make_client(self, config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
        from kvray.backends.mooncake import MooncakeBackend

        mc = as_backend(config, MooncakePoolConfig)
        return MooncakeBackend(
            mc.mooncake,
            address,
            io_threads=mc.io_threads,
            save_niceness=mc.save_niceness,
            contribute_memory=contribute_memory,
            replica_num=mc.replica_num,
        )

    def make_server(self, config: PoolConfig, host: str) -> MooncakeMaster:
        mc = as_backend(config, MooncakePoolConfig)
        log_dir = os.path.join(tempfile.gettempdir(), "kvray", mc.name)
        master = mc.master
        if mc.mooncake.enable_ssd_offload and not master.enable_offload:
            master = master.model_copy(update={"enable_offload": True})
        return MooncakeMaster(master, log_dir, host=host)

    def reachability(self, config: PoolConfig) -> list[tuple[str, str]]:
        address = as_backend(config, MooncakePoolConfig).mooncake.master_server_address
        return [("mooncake.master_server_address", address)] if address else []

    def client_env(self, config: PoolConfig) -> dict[str, str]:
        return as_backend(config, MooncakePoolConfig).mooncake.offload.env()

    def for_rank(self, config: PoolConfig, rank: int) -> PoolConfig:
        mc = as_backend(config, MooncakePoolConfig).mooncake
        if not mc.enable_client_http_server:
            return config
        # One client HTTP port per client of the node.
        mooncake = mc.model_copy(update={"client_http_port": mc.client_http_port + rank})
        return config.model_copy(update={"mooncake": mooncake})

    def on_node(self, config: PoolConfig, node_ip: str) -> PoolConfig:
        # A client advertises the address Ray knows its node by.
        mc = as_backend(config, MooncakePoolConfig).mooncake
        if mc.local_hostname is not None:
            return config
        mooncake = mc.model_copy(update={"local_hostname": node_ip})
        return config.model_copy(update={"mooncake": mooncake})

    def doctor_checks(
        self, config: PoolConfig, env: Mapping[str, str], host: Host
    ) -> list[Finding]:
        return mooncake_checks(config, env, host)


class Yuanrong(BackendSpec):
    """openYuanrong datasystem."""

    name = "yuanrong"
    server_name = "datasystem worker"
    client_section = "yuanrong"
    env_sections = ("yuanrong",)
    config_vars = ("DS_WORKER_ADDR",)
    node_local_fix = (
        "run a worker per node (scripts/datasystem_cluster.py) and set "
        "yuanrong.worker_address and node_worker_addresses, or keep engines on the "
        "pool's node"
    )

    def make_client(self, config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
        # A datasystem client contributes no memory either way: the worker owns it. It
        # connects to its node's worker (set by on_node), else the pool's.
        yr = as_backend(config, YuanrongPoolConfig).yuanrong
        address = yr.worker_address or address
        if yr.device == "npu":
            from kvray.backends.yuanrong_npu import YuanrongDeviceBackend

            return YuanrongDeviceBackend(
                yr, address, io_threads=config.io_threads, save_niceness=config.save_niceness
            )
        from kvray.backends.yuanrong import YuanrongBackend

        return YuanrongBackend(
            yr, address, io_threads=config.io_threads, save_niceness=config.save_niceness
        )

    def make_server(self, config: PoolConfig, host: str) -> DatasystemWorker:
        # Loopback whatever server_host says: the worker serves its own node's shared memory.
        return DatasystemWorker(as_backend(config, YuanrongPoolConfig).datasystem, name=config.name)

    def reachability(self, config: PoolConfig) -> list[tuple[str, str]]:
        yr = as_backend(config, YuanrongPoolConfig).yuanrong
        out = [("yuanrong.worker_address", yr.worker_address)] if yr.worker_address else []
        return out + [
            (f"yuanrong.node_worker_addresses[{ip}]", a)
            for ip, a in yr.node_worker_addresses.items()
        ]

    def device_setting(self, config: PoolConfig) -> DeviceSetting | None:
        npu = as_backend(config, YuanrongPoolConfig).yuanrong.device == "npu"
        return DeviceSetting("yuanrong.device", "npu", "host") if npu else None

    def on_node(self, config: PoolConfig, node_ip: str) -> PoolConfig:
        yr = as_backend(config, YuanrongPoolConfig).yuanrong
        if not yr.node_worker_addresses:
            return config
        worker = yr.address_on(node_ip)  # ConfigError if that node has none
        yuanrong = yr.model_copy(update={"worker_address": worker})
        return config.model_copy(update={"yuanrong": yuanrong})

    def per_node_server(self, config: PoolConfig) -> bool:
        return bool(as_backend(config, YuanrongPoolConfig).yuanrong.node_worker_addresses)

    def doctor_checks(
        self, config: PoolConfig, env: Mapping[str, str], host: Host
    ) -> list[Finding]:
        return yuanrong_checks(config, env, host)


class Memcache(BackendSpec):
    """Huawei MemCache."""

    name = "memcache"
    server_name = "MemCache MetaService"
    client_section = "memcache"
    env_sections = ("memcache", "memcache_meta")
    config_vars = ("MMC_LOCAL_CONFIG_PATH", "MMC_META_CONFIG_PATH")

    def make_client(self, config: PoolConfig, address: str, contribute_memory: bool) -> Backend:
        # The client finds its MetaService through config.memcache (the embedded one's
        # urls are written there: ServerProcess.client_settings).
        from kvray.backends.memcache import MemcacheBackend

        mmc = as_backend(config, MemcachePoolConfig).memcache
        return MemcacheBackend(
            mmc,
            contribute_memory=contribute_memory,
            io_threads=config.io_threads,
            save_niceness=config.save_niceness,
        )

    def make_server(self, config: PoolConfig, host: str) -> MetaService:
        meta = as_backend(config, MemcachePoolConfig).memcache_meta
        return MetaService(meta, host=host, name=config.name)

    def reachability(self, config: PoolConfig) -> list[tuple[str, str]]:
        url = as_backend(config, MemcachePoolConfig).memcache.meta_service_url
        return [("memcache.meta_service_url", url.split("://", 1)[-1])] if url else []

    def device_setting(self, config: PoolConfig) -> DeviceSetting | None:
        device = as_backend(config, MemcachePoolConfig).memcache.region == "device"
        return DeviceSetting("memcache.region", "device", "host") if device else None

    def node_cleanup(self, wait_s: float = 5.0) -> None:
        # A client's conf lives only through its init, so one is left only by a process
        # killed mid-init (an actor restarted as the pool is torn down): sweep until those
        # processes have exited, however long the kill takes on a loaded node.
        from kvray.backends.memcache import local_confs, remove_stale_local_confs

        deadline = time.monotonic() + wait_s
        while True:
            remove_stale_local_confs()
            if not local_confs() or time.monotonic() > deadline:
                return
            time.sleep(0.2)


SPECS: Mapping[str, BackendSpec] = MappingProxyType(
    {s.name: s for s in (Mooncake(), Yuanrong(), Memcache())}
)
assert set(SPECS) == set(get_args(BackendName)), "a backend without a registry row"


def spec_of(backend: str) -> BackendSpec:
    """The spec of ``backend`` (a validated ``PoolConfig.backend``)."""
    try:
        return SPECS[backend]
    except KeyError:
        raise AssertionError(f"no registry row for backend {backend!r}: kvray's bug") from None
