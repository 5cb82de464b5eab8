"""openYuanrong datasystem adapter: the :class:`~kvray.backends.base.Backend` contract over
``yr.datasystem.KVClient`` (the host data path).

Writes use the zero-copy pair ``mcreate`` + ``mset_buffer``: the worker hands out
shared-memory buffers, the rank's pieces are copied straight into them (no temporary
bytes) and the batch is published. Reads use ``get_buffers``: read-only views of the
worker's shared memory, copied straight into the destination pieces. A key's pieces at
one stride (a block's per-layer pieces) move in one strided numpy copy, others one
``memmove`` each. Both run on the adapter's own bounded thread pool (the native calls and
the copies release the GIL); large batches are split across its threads.

Keys are encoded for the datasystem's rules (:data:`~kvray.backends.keycodec.YUANRONG`)
before every call: ``mset`` silently drops a key it does not accept, so kvray never
sends one. The SDK raises ``RuntimeError("code: [<name>], msg: [...]")``; those codes
are mapped here and nowhere else (:func:`classify`).

Differences from Mooncake that callers see: a put does not overwrite unless asked
(checked with ``exist`` first, the datasystem itself is last-write-wins); reads take no
lease, so a block evicted between a lookup and its load is reported as a failed load.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvray.backends.base import (
    Backend,
    Check,
    KeyStatus,
    Pieces,
    Seal,
    gather_pieces,
    scatter_pieces,
)
from kvray.backends.blocking import BlockingCalls
from kvray.backends.keycodec import YUANRONG
from kvray.config import YuanrongConfig, parse_host_port
from kvray.errors import BackendError, BackendUnavailableError
from kvray.servers.process import check_reachable

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

PARALLEL_MIN_BYTES = 8 << 20
"""Batches at least this large are split across the adapter's threads."""
MAX_BATCH_KEYS = 1000
"""Keys per native call (``mcreate`` / ``mset_buffer`` accept fewer than 2000)."""

_CODE_RE = re.compile(r"code: \[([^\]]+)\]")
_RETRIES_RE = re.compile(r"RPC Retry detail: \[([^\]]*)\]")

# SDK status names that mean "the worker cannot serve", not "this key failed".
_UNAVAILABLE_WORDS = (
    "rpc unavailable",
    "deadline",
    "disconnect",
    "shutting down",
    "fd closed",
    "worker",
    "not ready",
    "timeout",
    "try again",
    "master",
    "scal",
    "recovery",
)


class _Unavailable(Exception):
    """Raised inside the worker threads; becomes BackendUnavailableError on the loop."""


def code_of(exc: BaseException) -> str:
    """The status name of an SDK error (``Key not found``, ``Out of memory``, ...)."""
    m = _CODE_RE.search(str(exc))
    return m.group(1) if m else str(exc).split("\n", 1)[0][:80]


def classify(exc: BaseException) -> KeyStatus | None:
    """Map one SDK error to the status of every key of its call; ``None`` means the
    worker is unavailable (a per-batch :class:`BackendUnavailableError`)."""
    code = code_of(exc).lower()
    if "not found" in code:
        return KeyStatus.NOT_FOUND
    if "out of memory" in code or "no space" in code or "lru" in code:
        return KeyStatus.POOL_FULL
    if "invalid" in code or "out of range" in code:
        return KeyStatus.INVALID
    if any(word in code for word in _UNAVAILABLE_WORDS):
        # The SDK retries "out of memory" until the request's timeout, so the last try of
        # a put into a full worker can end as "unavailable" ("RPC Retry detail: [ RPC
        # unavailable * 1 Out of memory * 3 ]"): a worker that answered "full" is up.
        retries = _RETRIES_RE.search(str(exc))
        if retries and "out of memory" in retries.group(1).lower():
            return KeyStatus.POOL_FULL
        return None
    return KeyStatus.ERROR


def check_worker_reachable(address: str, timeout_s: float) -> tuple[str, int]:
    """Fail fast and clearly when nothing listens at the worker address."""
    host, port = parse_host_port(address, field="yuanrong.worker_address")
    check_reachable(
        host,
        port,
        timeout_s,
        f"cannot reach the datasystem worker at {address} (yuanrong.worker_address or "
        "DS_WORKER_ADDR): {reason}. Start it (dscli start ... --worker_address ADDR), fix "
        "the address, or leave it unset so kvray runs one.",
    )
    return host, port


def import_datasystem() -> Any:
    """``yr.datasystem``, imported after ``mooncake.store`` when both are installed: the
    other order segfaults the process (yr preloads its own glog/protobuf/abseil)."""
    with contextlib.suppress(ImportError):
        import mooncake.store  # noqa: F401
    try:
        import yr.datasystem as ds
    except ImportError as exc:
        raise BackendUnavailableError(
            "backend 'yuanrong' needs openYuanrong datasystem: pip install 'kvray[yuanrong]'"
        ) from exc
    return ds


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


class DatasystemBackend(Backend):
    """What both datasystem data paths share: connection, key encoding, error mapping,
    exists/remove/close. Subclasses make the SDK client and move the bytes."""

    name = "yuanrong"
    data_path = "?"

    def __init__(
        self,
        config: YuanrongConfig,
        worker_address: str,
        *,
        io_threads: int = 4,
        save_niceness: int = 0,
    ) -> None:
        self._config = config
        self._address = worker_address
        host, port = check_worker_reachable(worker_address, config.connect_timeout_ms / 1e3)
        # The SDK reads its log directory once, when its logging starts.
        os.makedirs(config.client_log_dir, exist_ok=True)
        os.environ["DATASYSTEM_CLIENT_LOG_DIR"] = config.client_log_dir
        ds = import_datasystem()
        self._write_mode = (
            ds.WriteMode.NONE_L2_CACHE_EVICT
            if config.write_mode == "evict"
            else ds.WriteMode.NONE_L2_CACHE
        )
        started = time.monotonic()
        client = self._make_client(ds, host, port)
        try:
            client.init()
        except RuntimeError as exc:
            raise BackendUnavailableError(
                f"datasystem client could not connect to the worker at {worker_address}: "
                f"{code_of(exc)} (is it a datasystem worker, and ready?)"
            ) from exc
        self._client = client
        self._io_threads = io_threads
        self._calls = BlockingCalls(
            "datasystem client", "yr", io_threads, background_niceness=save_niceness
        )
        logger.info(
            "datasystem %s client connected to %s in %.0f ms (write mode %s, exclusive %s)",
            self.data_path,
            worker_address,
            (time.monotonic() - started) * 1e3,
            config.write_mode,
            config.enable_exclusive_connection,
        )

    @abc.abstractmethod
    def _make_client(self, ds: Any, host: str, port: int) -> Any:
        """The SDK client (not yet initialised)."""

    # ---- plumbing --------------------------------------------------------------------

    async def _call(self, fn: Callable[..., _T], *args: Any, background: bool = False) -> _T:
        """``fn`` on the adapter's threads (``background``: its store threads)."""
        try:
            return await (self._calls.background if background else self._calls)(fn, *args)
        except _Unavailable as exc:
            raise BackendUnavailableError(
                f"datasystem worker at {self._address} is unavailable: {exc} (it did not "
                f"answer within yuanrong.request_timeout_ms={self._config.request_timeout_ms})"
            ) from None
        except RuntimeError as exc:
            raise BackendError(f"datasystem call failed: {code_of(exc)}") from exc

    def _native(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run an SDK call; an 'unavailable' error escapes as :class:`_Unavailable`."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            if classify(exc) is None:
                raise _Unavailable(code_of(exc)) from exc
            raise

    async def _split(
        self,
        fn: Callable[[int, int], list[KeyStatus]],
        n: int,
        nbytes: int,
        *,
        background: bool = False,
    ) -> list[KeyStatus]:
        """Run ``fn(lo, hi)`` over slices: one per MAX_BATCH_KEYS, and spread over the
        adapter's threads when the batch is large enough to use several cores."""
        parts = self._io_threads if nbytes >= PARALLEL_MIN_BYTES else 1
        step = min(MAX_BATCH_KEYS, max(1, -(-n // parts)))
        results = await asyncio.gather(
            *(self._call(fn, lo, hi, background=background) for lo, hi in _chunks(n, step))
        )
        return [s for part in results for s in part]

    @staticmethod
    def _encode(keys: Sequence[str]) -> list[str]:
        return [YUANRONG.encode(k) for k in keys]

    # ---- contract --------------------------------------------------------------------

    def _exist(self, enc: list[str]) -> list[bool]:
        out: list[bool] = []
        for lo, hi in _chunks(len(enc), MAX_BATCH_KEYS):
            out += [bool(x) for x in self._native(self._client.exist, enc[lo:hi])]
        return out

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        try:
            return await self._call(self._exist, self._encode(keys))
        except BackendUnavailableError:
            raise
        except BackendError as exc:
            logger.warning("datasystem exist failed (%s): reading as absent", exc)
            return [False] * len(keys)

    async def _missing_first(
        self, enc: list[str], overwrite: bool
    ) -> tuple[list[KeyStatus], list[int]]:
        """All-OK statuses and the indexes still to write. First write wins, as in the
        contract: the datasystem overwrites, so keys already present are skipped (their
        bytes are the same block's anyway)."""
        out = [KeyStatus.OK] * len(enc)
        if overwrite:
            return out, list(range(len(enc)))
        present = await self._call(self._exist, enc)
        return out, [i for i, p in enumerate(present) if not p]

    @abc.abstractmethod
    def _writer(
        self, keys: list[str], ptrs: Pieces, sizes: Pieces, seal: Seal | None
    ) -> tuple[Callable[[int, int], list[KeyStatus]], int]:
        """``(write, nbytes)``: ``write(lo, hi)`` stores keys ``lo:hi`` (encoded keys,
        already filtered by first-write-wins; ``seal`` numbers them the same way) and
        returns their statuses."""

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
        out, todo = await self._missing_first(enc, overwrite)
        if not todo:
            return out

        write, nbytes = self._writer(
            [enc[i] for i in todo],
            [ptrs[i] for i in todo],
            [sizes[i] for i in todo],
            seal if seal is None or len(todo) == len(enc) else _SealOf(seal, todo),
        )
        statuses = await self._split(write, len(todo), nbytes, background=True)
        for i, status in zip(todo, statuses, strict=True):
            out[i] = status
        return out

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        # No leases here, so nothing is ever BUSY and ``force`` changes nothing.
        if not keys:
            return []
        enc = self._encode(keys)

        def delete() -> list[KeyStatus]:
            present = self._exist(enc)
            doomed = [k for k, p in zip(enc, present, strict=True) if p]
            failed: set[str] = set()
            for lo, hi in _chunks(len(doomed), MAX_BATCH_KEYS):
                failed.update(self._native(self._client.delete, doomed[lo:hi]))
            return [
                KeyStatus.NOT_FOUND if not p else (KeyStatus.ERROR if k in failed else KeyStatus.OK)
                for k, p in zip(enc, present, strict=True)
            ]

        return await self._call(delete)

    async def register_region(self, ptr: int, size: int) -> None:
        """Nothing to register: the datasystem reads and writes the given addresses
        directly (the host path copies in this process; the device path DMAs)."""

    async def unregister_region(self, ptr: int) -> None:
        """See :meth:`register_region`."""

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            # Blocks live in the worker's shared memory, not in memory this client gives.
            "segment": f"worker {self._address}",
            "segment_bytes": 0,
            "worker": self._address,
            "write_mode": self._config.write_mode,
            "data_path": self.data_path,
            "exclusive_connection": self._config.enable_exclusive_connection,
        }

    async def close(self) -> None:
        if not self._calls.closed:
            await self._calls.close()
            # The SDK has no close: dropping the last reference disconnects.
            del self._client


class _SealOf:
    """``seal`` of the keys a put writes (``todo``: their indices in the batch), in the
    writer's numbering."""

    def __init__(self, seal: Seal, todo: list[int]) -> None:
        self._seal, self._todo = seal, todo

    def __call__(self, lo: int, hi: int) -> None:
        for i in self._todo[lo:hi]:
            self._seal(i, i + 1)

    def in_value(self, i: int, value: int, nbytes: int) -> None:
        self._seal.in_value(self._todo[i], value, nbytes)


class YuanrongBackend(DatasystemBackend):
    """The host data path: one KVClient, zero-copy shared-memory buffers."""

    data_path = "host"

    def _make_client(self, ds: Any, host: str, port: int) -> Any:
        return ds.KVClient(
            host,
            port,
            connect_timeout_ms=self._config.connect_timeout_ms,
            req_timeout_ms=self._config.request_timeout_ms,
            enable_exclusive_connection=self._config.enable_exclusive_connection,
        )

    def _writer(
        self, keys: list[str], ptrs: Pieces, sizes: Pieces, seal: Seal | None
    ) -> tuple[Callable[[int, int], list[KeyStatus]], int]:
        def write(lo: int, hi: int) -> list[KeyStatus]:
            totals = [sum(s) for s in sizes[lo:hi]]
            try:
                bufs = self._native(self._client.mcreate, keys[lo:hi], totals, self._write_mode, 0)
                # The copy is this thread's: each key is sealed right after it is copied,
                # from its whole value (contiguous, and in this core's cache).
                for i, (buf, p, s, n) in enumerate(
                    zip(bufs, ptrs[lo:hi], sizes[lo:hi], totals, strict=True)
                ):
                    value = np.frombuffer(buf.MutableData(), np.uint8).ctypes.data
                    gather_pieces(value, p, s)
                    if seal:
                        seal.in_value(lo + i, value, n)
                self._native(self._client.mset_buffer, bufs)
            except RuntimeError as exc:
                status = classify(exc) or KeyStatus.ERROR
                logger.warning("datasystem put of %d key(s) failed: %s", hi - lo, code_of(exc))
                return [status] * (hi - lo)
            return [KeyStatus.OK] * (hi - lo)

        return write, sum(sum(s) for s in sizes)

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if not keys:
            return []
        enc = self._encode(keys)
        nbytes = sum(sum(s) for s in sizes)

        def read(lo: int, hi: int) -> list[KeyStatus]:
            try:
                bufs = self._native(self._client.get_buffers, enc[lo:hi], 0)
            except RuntimeError as exc:
                # The SDK raises when every key of the call is missing.
                return [classify(exc) or KeyStatus.ERROR] * (hi - lo)
            out: list[KeyStatus] = []
            # The copy is this thread's: each key's value is checked (with ``check``) as
            # the worker holds it, right before it is copied out (then from this core's
            # cache); one that fails is not copied.
            for i, (buf, p, s) in enumerate(zip(bufs, ptrs[lo:hi], sizes[lo:hi], strict=True)):
                n = sum(s)
                if buf is None:
                    out.append(KeyStatus.NOT_FOUND)
                elif buf.GetSize() != n:
                    out.append(KeyStatus.SIZE_MISMATCH)
                else:
                    value = np.frombuffer(buf, dtype=np.uint8).ctypes.data
                    if check is not None and not check.in_value(lo + i, value, n):
                        out.append(KeyStatus.CORRUPT)
                        continue
                    scatter_pieces(value, p, s)
                    out.append(KeyStatus.OK)
            return out

        return await self._split(read, len(enc), nbytes)

    async def health(self) -> bool:
        if self._calls.closed:
            return False
        status = await self._call(self._client.health_check)
        return bool(status.is_ok())
