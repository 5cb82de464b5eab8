"""Huawei MemCache adapter: the :class:`~kvray.backends.base.Backend` contract over
``memcache_hybrid.DistributedObjectStore`` (memcache-hybrid + memfabric-hybrid).

A key's pieces move with the layer-aware batch calls (``batch_put_from_layers`` /
``batch_get_into_layers``), one list of (address, size) per key, with the ``direct`` code
for where the rank's regions live: host memory (3 host->pool, 2 pool->host) or NPU
memory (0 device->pool, 1 pool->device). MemCache's return codes are mapped here and
nowhere else (:func:`status_of`).

A lookup client (``contribute_memory=False``) initialises with ``init_bm=False``, as
deployments' scheduler-side clients do: it mounts no memory, answers ``batch_is_exist``
and leases the hits it finds (``batch_add_lease``) so that they stay until loaded.

What runs where: the MetaService and a lookup client run on any machine. A client that
contributes memory (``init_bm=True``) needs the Ascend driver: on a machine without it
``init`` fails ("the current version of ascend driver does not support mf") and kvray
reports that as :class:`~kvray.errors.BackendUnavailableError`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvray.backends.base import Backend, Check, KeyStatus, Pieces, Seal, groups
from kvray.backends.blocking import BlockingCalls
from kvray.backends.keycodec import MEMCACHE
from kvray.config import MemcacheConfig, parse_host_port
from kvray.config.mmc_conf import render_conf
from kvray.errors import BackendUnavailableError
from kvray.servers.process import check_reachable
from kvray.shm import process_gone

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# MmcErrorCode (memcache src/memcache/csrc/common/mmc_types.h); the binding exports no
# enum, so the numbers live here, at the one boundary that sees them.
OK = 0
ERROR = -1
INVALID_PARAM = -3000
TIMEOUT = -3004
DUPLICATED_OBJECT = -3006
OBJECT_NOT_EXISTS = -3007
NOT_INITIALIZED = -3008
EXCEED_CAPACITY = -3013
LINK_NOT_FOUND = -3014
NOT_ENOUGH_MEMORY = -3016
NOT_CONNECT_META = -3017
NOT_CONNECT_LOCAL = -3018
CLIENT_NOT_INIT = -3019
UNMATCHED_KEY = -3102
LEASE_NOT_EXPIRED = -3104
LEASE_EXPIRED = -3106

# direct codes of the copy calls (memfabric BmCopyType)
DEVICE_TO_POOL, POOL_TO_DEVICE, POOL_TO_HOST, HOST_TO_POOL = 0, 1, 2, 3

MAX_BATCH_KEYS = 16384
"""MemCache's limit on keys per batch call."""

_STATUS: dict[int, KeyStatus] = {
    OK: KeyStatus.OK,
    OBJECT_NOT_EXISTS: KeyStatus.NOT_FOUND,
    UNMATCHED_KEY: KeyStatus.NOT_FOUND,
    NOT_ENOUGH_MEMORY: KeyStatus.POOL_FULL,
    EXCEED_CAPACITY: KeyStatus.POOL_FULL,
    LEASE_NOT_EXPIRED: KeyStatus.BUSY,
    LEASE_EXPIRED: KeyStatus.TRANSFER_FAILED,
    INVALID_PARAM: KeyStatus.INVALID,
}

# Codes that mean "this client cannot reach the MetaService", not "this key failed".
UNAVAILABLE = frozenset(
    {TIMEOUT, NOT_INITIALIZED, LINK_NOT_FOUND, NOT_CONNECT_META, NOT_CONNECT_LOCAL, CLIENT_NOT_INIT}
)


def status_of(code: int) -> KeyStatus:
    """Map one MemCache return code (0 or negative) to a per-key status."""
    return _STATUS.get(code, KeyStatus.ERROR)


def import_memcache() -> Any:
    """``memcache_hybrid`` (after ``mooncake.store`` where installed, like every native
    backend module here, so that one import order holds in every process)."""
    with contextlib.suppress(ImportError):
        import mooncake.store  # noqa: F401
    try:
        import memcache_hybrid
    except ImportError as exc:
        raise BackendUnavailableError(
            "backend 'memcache' needs MemCache: pip install 'kvray[memcache]'"
        ) from exc
    return memcache_hybrid


def local_conf_path() -> str:
    """This process's ``mmc-local.conf`` (``MMC_LOCAL_CONFIG_PATH``), set before MemCache
    is imported; refuses a process that imported MemCache with another path."""
    path = os.path.join(tempfile.gettempdir(), "kvray", f"mmc-local-{os.getpid()}.conf")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if "memcache_hybrid" in sys.modules and os.environ.get("MMC_LOCAL_CONFIG_PATH") != path:
        raise BackendUnavailableError(
            "memcache_hybrid was imported in this process before kvray set "
            "MMC_LOCAL_CONFIG_PATH, and MemCache reads that variable only at import: let "
            "kvray's BackendClient/Lookup actors (their own processes) own the MemCache client"
        )
    os.environ["MMC_LOCAL_CONFIG_PATH"] = path
    return path


def local_confs() -> list[Path]:
    """This node's per-process ``mmc-local-<pid>.conf`` files (each lives through one
    client's init)."""
    return list(Path(tempfile.gettempdir(), "kvray").glob("mmc-local-*.conf"))


def remove_stale_local_confs() -> list[str]:
    """Unlink the per-process ``mmc-local-<pid>.conf`` files of processes that are gone
    (killed in their client's init)."""
    removed = []
    for path in local_confs():
        pid = path.stem.rsplit("-", 1)[-1]
        if not pid.isdigit() or not process_gone(int(pid)):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def check_meta_reachable(url: str, timeout_s: float = 2.0) -> None:
    """Fail in seconds and clearly (MemCache's own init waits a fixed 5 s, then leaves
    the process's client unusable until it is reset)."""
    host, port = parse_host_port(url.split("://", 1)[-1], field="memcache.meta_service_url")
    check_reachable(
        host,
        port,
        timeout_s,
        f"cannot reach the MemCache MetaService at {url} (memcache.meta_service_url, "
        "ock.mmc.meta_service_url in MMC_LOCAL_CONFIG_PATH): {reason}. Start it, fix the "
        "url, or leave it unset so kvray runs one.",
    )


class MemcacheBackend(Backend):
    """One MemCache client. ``store_factory`` makes the ``DistributedObjectStore``; tests
    on machines without the Ascend driver pass the fake from ``tests/fakes``."""

    name = "memcache"

    def __init__(
        self,
        config: MemcacheConfig,
        *,
        contribute_memory: bool = True,
        io_threads: int = 4,
        save_niceness: int = 0,
        store_factory: Callable[[], Any] | None = None,
    ) -> None:
        if config.meta_service_url is None or config.config_store_url is None:
            raise BackendUnavailableError(
                "memcache client without meta_service_url/config_store_url: the launcher "
                "fills them in for an embedded MetaService; set them for an external one"
            )
        self._config = config
        self._url = config.meta_service_url
        self._lookup_client = not contribute_memory
        # The client reads mmc-local.conf at init from the file MMC_LOCAL_CONFIG_PATH
        # named when the library was loaded (measured: setting it after the import is not
        # seen). kvray points it at a per-process file and writes the typed config there
        # (extra keys included) before each client's init.
        self._conf_path = local_conf_path()
        Path(self._conf_path).write_text(
            render_conf(config.to_conf(), "written by kvray for its MemCache client")
        )
        try:
            if store_factory is None:
                check_meta_reachable(self._url)
                store_factory = import_memcache().DistributedObjectStore
            started = time.monotonic()
            store = store_factory()
            rc = store.init(config.device_id, init_bm=contribute_memory)
        finally:
            # The conf is read at init only, so it lives only as long as the init: a
            # process killed later (an actor Ray kills) cannot leave it behind.
            self._drop_conf()
        if rc != 0:
            self._reset_after_failed_init(store)
            hint = (
                "a client that contributes memory needs the Ascend driver (MemCache's data "
                "path does not run without it)"
                if contribute_memory
                else f"check that the MetaService at {self._url} runs"
            )
            raise BackendUnavailableError(
                f"MemCache init(device_id={config.device_id}, init_bm={contribute_memory}) "
                f"failed with code {rc} (protocol {config.protocol}): {hint}"
            )
        self._store = store
        dev = config.region == "device"
        self._put_direct = DEVICE_TO_POOL if dev else HOST_TO_POOL
        self._get_direct = POOL_TO_DEVICE if dev else POOL_TO_HOST
        self._regions: dict[int, int] = {}
        self._call = BlockingCalls(
            "MemCache client", "mmc", io_threads, background_niceness=save_niceness
        )
        logger.info(
            "MemCache %s client up in %.0f ms (meta %s, protocol %s, dram %d bytes)",
            "lookup" if self._lookup_client else "data",
            (time.monotonic() - started) * 1e3,
            self._url,
            config.protocol,
            config.dram_size if contribute_memory else 0,
        )

    def _drop_conf(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._conf_path)

    @staticmethod
    def _reset_after_failed_init(store: Any) -> None:
        """After a failed init, MemCache's process-wide client answers a second init with
        0 without connecting and fails every call after (-3014). Measured recipe that
        leaves the process able to connect later: init again, then close."""
        with contextlib.suppress(Exception):
            store.init(0, init_bm=False)
            store.close()

    # ---- plumbing --------------------------------------------------------------------

    def _raise_if_unavailable(self, op: str, codes: Sequence[int]) -> None:
        if codes and all(c in UNAVAILABLE for c in codes):
            raise BackendUnavailableError(
                f"MemCache {op}: every key failed with code {codes[0]}: the MetaService at "
                f"{self._url} is unreachable or dropped this client"
            )

    @staticmethod
    def _encode(keys: Sequence[str]) -> list[str]:
        return [MEMCACHE.encode(k) for k in keys]

    # ---- contract --------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        enc = self._encode(keys)

        def query() -> list[int]:
            codes: list[int] = list(self._store.batch_is_exist(enc))
            if self._lookup_client and self._config.lease_ttl_ms:
                hits = [k for k, c in zip(enc, codes, strict=True) if c == 1]
                if hits:
                    # Pin what the lookup found until it is loaded (or the lease ends).
                    self._store.batch_add_lease(hits, self._config.lease_ttl_ms)
            return codes

        codes = await self._call(query)
        self._raise_if_unavailable("exists", codes)
        return [c == 1 for c in codes]

    async def put(
        self,
        keys: Sequence[str],
        ptrs: Pieces,
        sizes: Pieces,
        *,
        overwrite: bool = False,
        seal: Seal | None = None,
    ) -> list[KeyStatus]:
        if not keys:
            return []
        enc = self._encode(keys)
        if overwrite:
            # MemCache never overwrites: drop the old object first (a reader in between
            # sees a miss, never mixed bytes).
            await self.remove(keys, force=True)

        def write() -> list[int]:
            """One native call, or (with ``seal``) one per group, each sealed right
            before it moves."""
            codes: list[int] = []
            for a, b in groups(sizes, 0, len(enc), seal=True) if seal else [(0, len(enc))]:
                if seal:
                    seal(a, b)
                codes += self._store.batch_put_from_layers(
                    enc[a:b],
                    [list(p) for p in ptrs[a:b]],
                    [list(s) for s in sizes[a:b]],
                    self._put_direct,
                )
            return codes

        codes = await self._call.background(write)
        self._raise_if_unavailable("put", codes)
        # A put of an existing key writes nothing: first write wins, as in the contract.
        return [KeyStatus.OK if c == DUPLICATED_OBJECT else status_of(c) for c in codes]

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if not keys:
            return []
        enc = self._encode(keys)

        def read() -> list[tuple[int, KeyStatus]]:
            """One native call, or (with ``check``) one per group, each checked as soon as
            it returns: each key's code and status."""
            out: list[tuple[int, KeyStatus]] = []
            for a, b in groups(sizes, 0, len(enc)) if check else [(0, len(enc))]:
                codes = self._store.batch_get_into_layers(
                    enc[a:b],
                    [list(p) for p in ptrs[a:b]],
                    [list(s) for s in sizes[a:b]],
                    self._get_direct,
                )
                statuses = [KeyStatus.OK if c > 0 else status_of(c) for c in codes]
                if check and KeyStatus.OK in statuses:
                    statuses = check(a, b, statuses)
                out += zip(codes, statuses, strict=True)
            return out

        results = await self._call(read)
        self._raise_if_unavailable("get", [code for code, _ in results])
        out = [status for _, status in results]
        failed = [i for i, s in enumerate(out) if s not in (KeyStatus.OK, KeyStatus.CORRUPT)]
        if failed:
            # Say why from the object's metadata: absent, another size, or a failed copy.
            infos = await self._call(self._store.batch_get_key_info, [enc[i] for i in failed])
            for i, info in zip(failed, infos, strict=True):
                stored = int(info.size())
                if stored == 0:
                    out[i] = KeyStatus.NOT_FOUND
                elif stored != sum(sizes[i]):
                    out[i] = KeyStatus.SIZE_MISMATCH
                elif out[i] is KeyStatus.ERROR:
                    out[i] = KeyStatus.TRANSFER_FAILED
        return out

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        if not keys:
            return []
        enc = self._encode(keys)

        def drop() -> list[int]:
            if force:
                self._store.batch_remove_lease(enc)
            return list(self._store.remove_batch(enc))

        codes = await self._call(drop)
        self._raise_if_unavailable("remove", codes)
        return [status_of(c) for c in codes]

    async def register_region(self, ptr: int, size: int) -> None:
        rc = await self._call(self._store.register_buffer, ptr, size)
        if rc != 0:
            raise BackendUnavailableError(f"MemCache register_buffer({size} bytes) failed: {rc}")
        self._regions[ptr] = size

    async def unregister_region(self, ptr: int) -> None:
        size = self._regions.pop(ptr, None)
        if size is None:
            return
        rc = await self._call(self._store.unregister_buffer, ptr, size)
        if rc != 0:
            logger.warning("MemCache unregister_buffer failed with code %d", rc)

    async def health(self) -> bool:
        if self._call.closed:
            return False
        code = await self._call(self._store.is_exist, "kvray-health-probe")
        return code in (0, 1)

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "segment": f"meta {self._url}",
            "segment_bytes": 0 if self._lookup_client else self._config.dram_size,
            "meta_service_url": self._url,
            "protocol": self._config.protocol,
            "region": self._config.region,
        }

    async def close(self) -> None:
        if not self._call.closed:
            await self._call.close(self._store.close)
