"""One pool: its name, ranks, backend sections, tiers and embedded servers.

:class:`PoolConfig` holds what every pool has; one subclass per backend adds that
backend's sections (:class:`MooncakePoolConfig`, :class:`YuanrongPoolConfig`,
:class:`MemcachePoolConfig`), chosen by ``backend`` when a config is parsed
(:meth:`PoolConfig.from_dict`, :meth:`PoolConfig.model_validate_json`). Users write the
same file either way; a section of another backend is refused, naming the fix.
"""

from __future__ import annotations

import ipaddress
import json
import os
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Self, TypeVar, cast, get_args

from pydantic import Field, PrivateAttr, model_validator
from pydantic.config import ExtraValues

from kvray.config._common import (
    BackendName,
    ByteSize,
    MiB,
    _read_json,
    _Strict,
    read_yaml,
    validate,
)
from kvray.config.kv_events import KVEventsConfig
from kvray.config.memcache import MemcacheConfig, MemcacheMetaConfig
from kvray.config.mooncake import MooncakeConfig, MooncakeMasterConfig
from kvray.config.ssd import SsdConfig
from kvray.config.yuanrong import DatasystemWorkerConfig, YuanrongConfig

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
SERVER_HOSTS = ("auto", "node", "loopback")
"""``server_host``'s words (else an IP address)."""


def _check_host(field: str, host: str) -> None:
    """``server_host``'s rule: one of :data:`SERVER_HOSTS` or one IP address."""
    if host in SERVER_HOSTS:
        return
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{field} {host!r}: write auto, node, loopback or an IP address of the "
            "node the pool's manager runs on"
        ) from None
    if ip.is_unspecified:
        raise ValueError(
            f"{field} {host!r} would listen on every interface and give clients an "
            "address nobody can connect to: write node (the address Ray knows the node "
            "by) or one of the node's IP addresses"
        )


@dataclass(frozen=True)
class Pipeline:
    """A pool's tiers, fastest first: its DRAM backend, then (``ssd``) kvray's SSD tier
    below it. Written ``"<backend>"`` or ``"<backend>|ssd"`` (``PoolConfig.pipeline``)."""

    backend: BackendName
    ssd: bool = False

    @classmethod
    def parse(cls, text: str) -> Pipeline | None:
        """``"mooncake|ssd"`` -> ``Pipeline("mooncake", ssd=True)``; None if malformed."""
        first, *rest = (t.strip() for t in text.split("|"))
        if first not in get_args(BackendName) or rest not in ([], ["ssd"]):
            return None
        return cls(cast(BackendName, first), ssd=bool(rest))

    def __str__(self) -> str:
        return f"{self.backend}|ssd" if self.ssd else self.backend


class PoolConfig(_Strict):
    """One kvray pool: its actors, ranks, backend and embedded servers. What every backend
    shares; a config is always of the subclass its ``backend`` names, which adds that
    backend's sections (parse with :meth:`from_dict`, :meth:`from_file` or
    :meth:`model_validate_json`, which choose it)."""

    name: str = Field("kvray", pattern=_NAME_PATTERN)
    """Pool name; its actors are named ``<name>.manager``, ``<name>.client.<node>.<slot>``,
    ``<name>.ssd.<node>.<slot>`` and ``<name>.lookup.<node>`` (kvray.naming)."""
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
    save_niceness: int = Field(19, ge=0, le=19)
    """Niceness of the work that stores blocks in each BackendClient: the backend's puts and
    their checksums, the SSD tier's writes, and Mooncake's own copy thread while no load is
    in flight (it copies a store's bytes into the segment and a load's out of it; a load
    raises it to its own niceness until done). An engine's forward on the same cores comes
    first; the stores run in its gaps. A repeat sent while its saves are slowed waits
    longer for them. Lowering the copy thread's niceness again for a load needs
    ``CAP_SYS_NICE`` (root has it); without it that thread keeps its own. 0 runs stores
    beside the forward at its priority (docs/benchmarks.md measures both)."""
    checksum: bool = True
    """Every block stored in the backend carries an xxh3-64 of its key and bytes (an
    8-byte trailer written with it), checked on every load before the engine may use the
    bytes: a mismatch is a failed load (recomputed), counted, and the block is removed.
    On by default: a cache must never serve wrong bytes, and what users pay is a fraction
    of a millisecond of a hit's TTFT (docs/reliability.md, "Block checksums").
    ``false`` opts out: a block corrupted in the backend's memory, its transfers or its
    native SSD offload (or served wrong by a backend bug, as Mooncake's batch get once
    did) is then loaded into the engine as it is. All clients of a pool agree (the setting
    is the pool's). The SSD tier checks its own files either way. Paths that move device
    memory (``yuanrong.device: npu``, ``memcache.region: device``) have no trailer:
    ``kvray doctor`` says so."""
    transfer_window_size: ByteSize = 64 * MiB
    """Shared-memory staging window per Pool client and rank (copies of foreign tensors)."""
    call_timeout_s: float = Field(60.0, gt=0)
    """Timeout of one data-plane actor call (a whole batch)."""
    lookup_timeout_s: float = Field(5.0, gt=0)
    """Timeout of one Pool API lookup call."""
    lookup_index: bool = True
    """Each node keeps an index of the pool's blocks in shared memory, kept current by a
    stream of every client's stores, removes, keys found gone and the backend's evictions
    (each client reconciles what it stored), through the manager; the schedulers on the
    node answer lookups from it in microseconds, with no actor call, and pin a step's
    loads with one call (kvray/index/block_index.py). A block the index shows that is gone by
    its load is a failed load (recomputed, ``gone_at_load``). False: every lookup is a
    call to the node's Lookup actor, which asks the backend."""
    lookup_index_blocks: int = Field(1 << 20, ge=1024, le=1 << 28)
    """Keys the index holds (every rank's and layer group's key of a block counts): 32
    bytes of shared memory per key on each node, and as much in the manager (1 Mi keys:
    32 MiB). Past it the keys stored longest ago read as misses. Size it to the keys the
    pool's DRAM and SSD can hold: their bytes over the bytes of one key."""
    detached: bool = True
    """Pool actors outlive the process that started them (``kvray down`` stops them)."""
    server_host: str = "auto"
    """Where the pool's embedded server (the ``mooncake_master``, MemCache's MetaService)
    listens, decided when the pool starts (``kvray up``, ``Pool.start``):

    - ``auto`` (default): ``node`` when the Ray cluster has more than one alive node at
      start, else ``loopback``;
    - ``node``: the address Ray knows the manager's node by (the node the server runs on,
      not necessarily the head), so that clients on every node reach it;
    - ``loopback``: 127.0.0.1, reachable from the manager's node only;
    - an IP address of the manager's node (another interface, e.g. the storage network).

    Never 0.0.0.0: the server listens on one address, and clients are given that one. A
    client on another node of a pool whose server listens on loopback is refused when it
    attaches, naming the fix (restart the pool with ``server_host: node``). The embedded
    datasystem worker always listens on loopback: it serves its own node's shared memory
    (``yuanrong.node_worker_addresses`` gives every node its own worker)."""

    kv_events: KVEventsConfig | None = None
    """Publish the pool's blocks as vLLM KV events (off: null). Needs ``lookup_index``
    and vLLM importable where the pool's manager runs. docs/operations.md."""

    _tiers: Pipeline = PrivateAttr()

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
    def _server_host(self) -> PoolConfig:
        _check_host("server_host", self.server_host)
        if self.kv_events is not None:
            _check_host("kv_events.host", self.kv_events.host)
            if not self.lookup_index:
                raise ValueError(
                    "kv_events publishes what the pool's block index holds: set "
                    "lookup_index: true (the default), or remove kv_events"
                )
        return self

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
        # Parsed once, here; the field keeps its string (the JSON form actors get).
        tiers = Pipeline(self.backend) if self.pipeline is None else Pipeline.parse(self.pipeline)
        if tiers is None or tiers.backend != self.backend:
            raise ValueError(
                f"pipeline {self.pipeline!r}: write '{self.backend}' or '{self.backend}|ssd' "
                "(the pool's backend first, then optionally the ssd tier)"
            )
        if tiers.ssd and self.ssd is None:
            raise ValueError(f"pipeline {self.pipeline!r} needs an ssd section (ssd.path, ...)")
        self._tiers = tiers
        return self

    def listen_host(self, node_ip: str, alive_nodes: int, host: str | None = None) -> str:
        """The address the embedded server listens on and clients are given, on a node
        Ray knows as ``node_ip`` in a cluster of ``alive_nodes`` nodes (``server_host``,
        or ``host`` written by its rule: ``kv_events.host``)."""
        host = self.server_host if host is None else host
        if host == "auto":
            host = "node" if alive_nodes > 1 else "loopback"
        if host == "loopback":
            return "127.0.0.1"
        return node_ip if host == "node" else host

    @property
    def tiers(self) -> Pipeline:
        """``pipeline`` parsed (the backend alone when unset)."""
        return self._tiers

    @property
    def ssd_tier(self) -> bool:
        """Whether the pool chains kvray's SSD tier under its DRAM backend."""
        return self._tiers.ssd

    @property
    @abstractmethod
    def configured_server(self) -> str | None:
        """The address of an external server the config names; None: kvray runs its own."""

    @property
    def embedded_server(self) -> bool:
        """Whether kvray runs the backend's server itself (no address configured)."""
        return self.configured_server is None

    @classmethod
    def misplaced(cls, field: str) -> str | None:
        # Another backend's section: say whose, not "a typo?".
        for backend, model in POOL_CONFIGS.items():
            if field in model.model_fields and field not in cls.model_fields:
                return (
                    f"only for backend '{backend}' (this pool's backend is "
                    f"'{cls.model_fields['backend'].default}'): remove the section or set "
                    f"backend: {backend}"
                )
        return None

    @classmethod
    def model_for(cls, backend: object) -> type[PoolConfig] | None:
        """The config class of ``backend`` (a config's ``backend`` value, "mooncake" when
        absent); None when it names no backend."""
        return POOL_CONFIGS.get(backend) if isinstance(backend, str) else None

    @classmethod
    def model_validate(
        cls,
        obj: Any,
        *,
        strict: bool | None = None,
        extra: ExtraValues | None = None,
        from_attributes: bool | None = None,
        context: Any | None = None,
        by_alias: bool | None = None,
        by_name: bool | None = None,
    ) -> Self:
        """On :class:`PoolConfig`: the config of the subclass ``obj``'s ``backend`` names
        (no environment read: :meth:`from_dict` for configs as users write them)."""
        kw: dict[str, Any] = dict(
            strict=strict,
            extra=extra,
            from_attributes=from_attributes,
            context=context,
            by_alias=by_alias,
            by_name=by_name,
        )
        model = cls._chosen(obj)
        if model is not None:
            return cast(Self, model.model_validate(obj, **kw))
        return super().model_validate(obj, **kw)

    @classmethod
    def model_validate_json(
        cls,
        json_data: str | bytes | bytearray,
        *,
        strict: bool | None = None,
        extra: ExtraValues | None = None,
        context: Any | None = None,
        by_alias: bool | None = None,
        by_name: bool | None = None,
    ) -> Self:
        """On :class:`PoolConfig`: the config of the subclass the JSON's ``backend`` names
        (the form the pool's actors get, ``model_dump_json``)."""
        kw: dict[str, Any] = dict(
            strict=strict, extra=extra, context=context, by_alias=by_alias, by_name=by_name
        )
        model = cls._chosen(json.loads(json_data))
        if model is not None:
            return cast(Self, model.model_validate_json(json_data, **kw))
        return super().model_validate_json(json_data, **kw)

    @classmethod
    def _chosen(cls, data: Any) -> type[PoolConfig] | None:
        """The subclass to validate ``data`` with when asked of :class:`PoolConfig` itself;
        None: validate as asked (a subclass, or no backend to choose one by, when pydantic
        then names what is wrong)."""
        if cls is not PoolConfig or not isinstance(data, Mapping):
            return None
        return cls.model_for(data.get("backend", "mooncake"))

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
        """Validate ``data`` (a pool config as users write it) into the config of the
        backend it names; without the backend's client section (and, for memcache, its
        MetaService's) those come from the environment (``from_env``)."""
        data = dict(data or {})
        backend = data.get("backend", "mooncake")
        model = PoolConfig.model_for(backend)
        if model is None:
            # No backend to choose the sections by: the common fields alone name the bad
            # backend (and any other bad field); the sections are checked once it is fixed.
            # Validation fails on ``backend``, before the abstract class could be made.
            common = {k: v for k, v in data.items() if k not in _SECTIONS}
            return validate(PoolConfig, common, source=source)  # type: ignore[type-abstract]
        if backend == "mooncake" and "mooncake" not in data:
            data["mooncake"] = MooncakeConfig.from_env(environ)
        if backend == "yuanrong" and "yuanrong" not in data:
            data["yuanrong"] = YuanrongConfig.from_env(environ)
        if backend == "memcache":
            if "memcache" not in data:
                data["memcache"] = MemcacheConfig.from_env(environ)
            if "memcache_meta" not in data:
                data["memcache_meta"] = MemcacheMetaConfig.from_env(environ)
        return validate(model, data, source=source)


class MooncakePoolConfig(PoolConfig):
    """A pool on Mooncake (``backend: mooncake``, the default)."""

    backend: Literal["mooncake"] = "mooncake"
    """Storage backend: Mooncake."""
    mooncake: MooncakeConfig = Field(default_factory=MooncakeConfig)
    """Mooncake client settings (``mooncake.json``)."""
    master: MooncakeMasterConfig = Field(default_factory=MooncakeMasterConfig)
    """Flags of the embedded ``mooncake_master`` (used only without a master address)."""

    @property
    def configured_server(self) -> str | None:
        return self.mooncake.master_server_address


class YuanrongPoolConfig(PoolConfig):
    """A pool on openYuanrong datasystem (``backend: yuanrong``)."""

    backend: Literal["yuanrong"] = "yuanrong"
    """Storage backend: openYuanrong datasystem."""
    yuanrong: YuanrongConfig = Field(default_factory=YuanrongConfig)
    """openYuanrong datasystem client settings (``DS_*`` environment variables)."""
    datasystem: DatasystemWorkerConfig = Field(default_factory=DatasystemWorkerConfig)
    """The embedded datasystem worker (used only without a worker address)."""

    @property
    def configured_server(self) -> str | None:
        return self.yuanrong.worker_address


class MemcachePoolConfig(PoolConfig):
    """A pool on Huawei MemCache (``backend: memcache``)."""

    backend: Literal["memcache"] = "memcache"
    """Storage backend: Huawei MemCache (its data path needs the Ascend driver)."""
    memcache: MemcacheConfig = Field(default_factory=MemcacheConfig)
    """MemCache client settings (``mmc-local.conf``)."""
    memcache_meta: MemcacheMetaConfig = Field(default_factory=MemcacheMetaConfig)
    """The embedded MemCache MetaService (used only without a meta_service_url)."""

    @model_validator(mode="after")
    def _memcache_ranks(self) -> Self:
        if self.world_size > self.memcache.world_size:
            raise ValueError(
                f"world_size {self.world_size} exceeds memcache.world_size "
                f"{self.memcache.world_size} (ock.mmc.local_service.world_size): raise it"
            )
        return self

    @property
    def configured_server(self) -> str | None:
        return self.memcache.meta_service_url


POOL_CONFIGS: Mapping[str, type[PoolConfig]] = MappingProxyType(
    {"mooncake": MooncakePoolConfig, "yuanrong": YuanrongPoolConfig, "memcache": MemcachePoolConfig}
)
"""The config class of each backend."""
assert set(POOL_CONFIGS) == set(get_args(BackendName)), "a backend without a config class"

_C = TypeVar("_C", bound=PoolConfig)


def as_backend(config: PoolConfig, model: type[_C]) -> _C:
    """``config`` as the config of the backend a caller serves (a registry row, a
    backend's checks), which only ever gets configs of its backend."""
    assert isinstance(config, model), (
        f"{model.__name__} expected, got a {config.backend!r} pool config: kvray's bug"
    )
    return config


_SECTIONS = frozenset(f for model in POOL_CONFIGS.values() for f in model.model_fields) - frozenset(
    PoolConfig.model_fields
)
"""Every backend's sections."""
