"""Mooncake Store adapter: the :class:`~kvray.backends.base.Backend` contract over
``mooncake.store.MooncakeDistributedStore``.

Mooncake's negative return codes are mapped here and nowhere else (:func:`status_of`).
Its zero-copy batch calls release the GIL, so they run on the adapter's own bounded
thread pool while the actor's event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from kvray.backends import copy_thread
from kvray.backends.base import Backend, Check, KeyStatus, Pieces, Seal, groups
from kvray.backends.blocking import BlockingCalls
from kvray.backends.segment_warmer import SegmentWarmer, anonymous_ranges, new_ranges
from kvray.config import MooncakeConfig, parse_host_port
from kvray.errors import BackendUnavailableError
from kvray.servers.process import check_reachable

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

FULL_RETRY_S = (0.02, 0.05, 0.1, 0.2, 0.4)
"""A put's keys the pool had no room for are put again after each of these waits, until
stored: the master evicts asynchronously (once its use passes the high watermark), so a
burst into a full pool fails until an eviction round freed room. Measured (64 MiB
segment, bursts of 32 x 1 MiB sent back to back into the full pool): without this, 8 of
32, then 0 of 32 stored; with it, 32 of 32 in about 180 ms each. The wait (at most
0.77 s) is the save's, never a request's."""

PARALLEL_MIN_BYTES = 8 << 20
"""Batches at least this large are split across the adapter's threads."""

# Mooncake ErrorCode values (mooncake-store/include/types.h); the binding does not
# export the enum, so the numbers live here, at the one boundary that sees them.
OK = 0
INTERNAL_ERROR = -1
CLIENT_NOT_FOUND = -103
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
INVALID_REPLICA = -702
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
REPLICA_NOT_FOUND = -710
REPLICA_IS_GONE = -712
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
TENANT_QUOTA_EXCEEDED = -1700

_STATUS: dict[int, KeyStatus] = {
    OK: KeyStatus.OK,
    NO_AVAILABLE_HANDLE: KeyStatus.POOL_FULL,
    TENANT_QUOTA_EXCEEDED: KeyStatus.POOL_FULL,
    OBJECT_NOT_FOUND: KeyStatus.NOT_FOUND,
    # Replica states seen while an object is being written, evicted or dropped with a
    # dead client: the object is not readable, which for a cache is a miss.
    INVALID_REPLICA: KeyStatus.NOT_FOUND,
    REPLICA_IS_NOT_READY: KeyStatus.NOT_FOUND,
    REPLICA_NOT_FOUND: KeyStatus.NOT_FOUND,
    REPLICA_IS_GONE: KeyStatus.NOT_FOUND,
    OBJECT_HAS_LEASE: KeyStatus.BUSY,
    LEASE_EXPIRED: KeyStatus.TRANSFER_FAILED,
    TRANSFER_FAIL: KeyStatus.TRANSFER_FAILED,
    CHECKSUM_MISMATCH: KeyStatus.TRANSFER_FAILED,
    INVALID_KEY: KeyStatus.INVALID,
    INVALID_PARAMS: KeyStatus.INVALID,
}

# Codes that mean "the client cannot talk to the cluster", not "this key failed".
_UNAVAILABLE = frozenset({INTERNAL_ERROR, CLIENT_NOT_FOUND, ILLEGAL_CLIENT, RPC_FAIL, RPC_TIMEOUT})


def status_of(code: int) -> KeyStatus:
    """Map one Mooncake return code (0 or negative) to a per-key status."""
    return _STATUS.get(code, KeyStatus.ERROR)


def _raise_if_unavailable(op: str, codes: Sequence[int], address: str) -> None:
    if codes and all(c in _UNAVAILABLE for c in codes):
        raise BackendUnavailableError(
            f"mooncake {op}: every key failed with code {codes[0]}: the master at {address} "
            "is unreachable or dropped this client. The client stays: once a master listens "
            "on that address again (the pool restarts an embedded one itself) it mounts its "
            "segment there and serves; blocks the old master held are misses"
        )


def _total(sizes: Pieces) -> int:
    return sum(sum(s) for s in sizes)


def _got(code: int, sizes: Sequence[int]) -> KeyStatus:
    """A get's per-key outcome: ``code`` is the bytes read, or a negative error code."""
    if code >= 0:
        return KeyStatus.OK if code == sum(sizes) else KeyStatus.SIZE_MISMATCH
    if code == INVALID_PARAMS:
        # get_into answers -600 when the destination is smaller than the object.
        return KeyStatus.SIZE_MISMATCH
    return status_of(code)


def check_master_reachable(address: str, timeout_s: float = 2.0) -> None:
    """Fail in ``timeout_s`` with a clear message, instead of Mooncake's ~90 s of retries."""
    host, port = parse_host_port(address, field="mooncake.master_server_address")
    check_reachable(
        host,
        port,
        timeout_s,
        f"cannot reach mooncake_master at {address} (mooncake.master_server_address or "
        "MOONCAKE_MASTER): {reason}. Start the master, fix the address, or leave it unset so "
        "kvray runs one itself.",
    )


class MooncakeBackend(Backend):
    """One Mooncake client: contributes ``global_segment_size`` bytes to the pool (0 for a
    lookup-only client) and moves bytes with ``batch_put_from`` / ``batch_get_into``."""

    name = "mooncake"

    def __init__(
        self,
        config: MooncakeConfig,
        master_address: str,
        *,
        io_threads: int = 4,
        save_niceness: int = 0,
        contribute_memory: bool = True,
        replica_num: int = 1,
    ) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._config = config
        self._address = master_address
        check_master_reachable(master_address)
        segment = config.global_segment_size if contribute_memory else 0
        store = MooncakeDistributedStore()
        started = time.monotonic()
        before = anonymous_ranges() if segment and config.prefault_segment else None
        threads_before = copy_thread.threads()
        rc = store.setup(
            # kvray's node actors fill in their node's address; a client made directly
            # (tests, tools without Ray) advertises loopback.
            config.local_hostname or "127.0.0.1",
            config.metadata_server,
            segment,
            config.local_buffer_size if contribute_memory else 0,
            config.protocol,
            config.device_name,
            master_address,
            None,
            bool(config.enable_ssd_offload and contribute_memory),
            (config.ssd_offload_path or "") if contribute_memory else "",
            tenant_id=config.tenant_id,
            # Only storing clients serve it (a lookup client would take the same port).
            enable_client_http_server=config.enable_client_http_server and contribute_memory,
            client_http_port=config.client_http_port,
        )
        if rc != 0:
            raise BackendUnavailableError(
                f"mooncake setup against {master_address} failed with code {rc} "
                f"(protocol={config.protocol!r}, metadata_server={config.metadata_server!r}); "
                "check that the master runs and the protocol matches the hardware"
            )
        self._store = store
        self._segment_bytes = segment
        self._segment_name = str(store.get_hostname())
        # (the threads setup started, before the warmer's: one of them copies)
        self._copier = copy_thread.CopyThread(
            f"mooncake client {self._segment_name}",
            copy_thread.threads() - threads_before,
            save_niceness,
        )
        self._warmer: SegmentWarmer | None = None
        if before is not None:
            # (the largest new mappings, as much as the segment: not the local buffer)
            ranges, room = [], segment
            for lo, hi in new_ranges(before, anonymous_ranges()):
                if room > 0:
                    ranges.append((lo, min(hi, lo + room)))
                    room -= hi - lo
            self._warmer = SegmentWarmer.start(ranges, f"mooncake client {self._segment_name}")
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = replica_num
        if segment and (config.preferred_segment or config.prefer_alloc_in_same_node):
            # The native prefer_alloc_in_same_node flag makes batch_put_from reject the
            # whole batch (-600) in 0.3.x; the local segment is the same-node choice.
            self._replicate.preferred_segments = [self._segment_name]
        self._io_threads = io_threads
        self._call = BlockingCalls(
            "mooncake client", "mooncake", io_threads, background_niceness=save_niceness
        )
        logger.info(
            "mooncake client %s up in %.0f ms (segment %d bytes, protocol %s, master %s)",
            self._segment_name,
            (time.monotonic() - started) * 1e3,
            segment,
            config.protocol,
            master_address,
        )

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = await self._call(self._store.batch_is_exist, list(keys))
        _raise_if_unavailable("exists", codes, self._address)
        return [c == 1 for c in codes]

    def _slices(self, n: int, nbytes: int) -> list[tuple[int, int]]:
        """One slice, or ``io_threads`` contiguous ones when the batch is large: each is
        one native call on a thread of its own (the calls release the GIL). A replica in
        this client's own segment is copied by Mooncake's single memcpy thread however
        the batch is split; what the split runs in parallel is each call's checksum
        work (``seal``, ``check``) beside the copy, and for replicas on other nodes the
        transport's transfers."""
        parts = min(self._io_threads, n) if nbytes >= PARALLEL_MIN_BYTES else 1
        bounds = [n * i // parts for i in range(parts + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

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
        keys = list(keys)
        lists: list[list[Any]]
        if all(len(p) == 1 for p in ptrs):
            fn = self._store.batch_upsert_from if overwrite else self._store.batch_put_from
            lists = [[p[0] for p in ptrs], [s[0] for s in sizes]]
        else:
            if overwrite:
                # Mooncake has no multi-buffer upsert: remove, then write. A reader in
                # between sees a miss, never mixed bytes.
                await self._call(self._store.batch_remove, keys, True)
            fn = self._store.batch_put_from_multi_buffers
            lists = [[list(p) for p in ptrs], [list(s) for s in sizes]]

        def write(lo: int, hi: int) -> list[int]:
            """Keys ``lo:hi``: one native call, or (with ``seal``) one per group, each
            sealed right before it moves."""
            codes: list[int] = []
            for a, b in groups(sizes, lo, hi, seal=True) if seal else [(lo, hi)]:
                if seal:
                    seal(a, b)
                codes += fn(keys[a:b], *(col[a:b] for col in lists), self._replicate)
            return codes

        nbytes = _total(sizes)
        self._copier.before_store()
        slices = self._slices(len(keys), nbytes)
        parts = await asyncio.gather(*(self._call.background(write, lo, hi) for lo, hi in slices))
        self._copier.after_store(nbytes)
        codes = [code for part in parts for code in part]
        _raise_if_unavailable("put", codes, self._address)
        for wait in FULL_RETRY_S:
            full = [i for i, c in enumerate(codes) if c == NO_AVAILABLE_HANDLE]
            if not full:
                break
            # (sealed already: the trailers are still in place beside the bytes)
            await asyncio.sleep(wait)
            again = await self._call.background(
                fn, [keys[i] for i in full], *([col[i] for i in full] for col in lists),
                self._replicate,
            )  # fmt: skip
            _raise_if_unavailable("put", again, self._address)
            for i, code in zip(full, again, strict=True):
                codes[i] = code
        return [status_of(c) for c in codes]

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if not keys:
            return []
        keys = list(keys)
        single = all(len(p) == 1 for p in ptrs)
        fn = self._store.batch_get_into if single else self._store.batch_get_into_multi_buffers
        lists: list[list[Any]] = (
            [[p[0] for p in ptrs], [s[0] for s in sizes]]
            if single
            else [[list(p) for p in ptrs], [list(s) for s in sizes]]
        )

        def read(lo: int, hi: int) -> list[tuple[int, KeyStatus]]:
            """Keys ``lo:hi``: one native call, or (with ``check``) one per group, each
            checked as soon as it returns."""
            out: list[tuple[int, KeyStatus]] = []
            for a, b in groups(sizes, lo, hi) if check else [(lo, hi)]:
                codes = list(fn(keys[a:b], *(col[a:b] for col in lists)))
                statuses = [_got(r, s) for r, s in zip(codes, sizes[a:b], strict=True)]
                if check and KeyStatus.OK in statuses:
                    statuses = check(a, b, statuses)
                out += zip(codes, statuses, strict=True)
            return out

        self._copier.load_started()
        try:
            parts = await asyncio.gather(
                *(self._call(read, lo, hi) for lo, hi in self._slices(len(keys), _total(sizes)))
            )
        finally:
            self._copier.load_ended()
        results = [x for part in parts for x in part]
        _raise_if_unavailable("get", [code for code, _ in results], self._address)
        return [status for _, status in results]

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        if not keys:
            return []
        codes = await self._call(self._store.batch_remove, list(keys), force)
        _raise_if_unavailable("remove", codes, self._address)
        return [status_of(c) for c in codes]

    async def register_region(self, ptr: int, size: int) -> None:
        rc = await self._call(self._store.register_buffer, ptr, size)
        if rc != 0:
            raise BackendUnavailableError(
                f"mooncake register_buffer({size} bytes) failed with code {rc}"
            )

    async def unregister_region(self, ptr: int) -> None:
        rc = await self._call(self._store.unregister_buffer, ptr)
        if rc != 0:
            logger.warning("mooncake unregister_buffer failed with code %d", rc)

    async def health(self) -> bool:
        return bool(await self._call(self._store.health_check) == 0)

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "segment": self._segment_name,
            "segment_bytes": self._segment_bytes,
            # (mapped ahead of stores so far: prefault_segment)
            "segment_mapped_bytes": self._warmer.mapped if self._warmer else None,
            # (held at save_niceness while no load is in flight; None: not found or not held)
            "copy_thread": self._copier.tid,
            "master": self._address,
            "protocol": self._config.protocol,
            "ssd_offload_path": self._config.ssd_offload_path
            if self._config.enable_ssd_offload
            else None,
        }

    async def close(self) -> None:
        if self._warmer is not None:
            await asyncio.to_thread(self._warmer.stop)
        await self._call.close(self._store.close)
