"""The SSD tier: one rank's blocks as files under ``<ssd_path>/rank_<N>/``, behind the
same :class:`~kvray.backends.base.Backend` contract as the DRAM backends (so the rank's
SSD offload actor is a RankStore over it, and the contract suite runs against it).

On disk, one file per block, ``blocks/<2 hex>/<sha256 of key>.blk``::

    header (fixed 48 bytes): magic, version, header length, payload length, xxh3-64 of
                             the payload, write sequence number, key length
    key (utf-8), zero padding up to the payload offset (4096 with direct I/O or for
                             payloads of 64 KiB or more)
    payload: the key's pieces, concatenated

- **Atomic**: a block is written to ``tmp/`` and renamed into place, so a crash leaves
  either the whole block or nothing visible; ``tmp/`` is emptied at start.
- **Persistent index**: rebuilt at start from the headers (the tier survives pool and
  machine restarts); FIFO order by write sequence, LRU order by file mtime (touched on
  every hit).
- **Quota** per rank in bytes (payload + header), with eviction ``none`` (a put that does
  not fit reports pool full), ``fifo`` or ``lru``.
- **Checksums**: xxh3-64 of the payload, verified on every read; a bad block is reported as
  a miss (its destination bytes are never used) and its file removed.
- Bytes move with ``os.pwritev`` / ``os.preadv`` straight between the caller's memory
  (the rank's shared regions) and the file: no intermediate copy; several keys at once on
  ``io_threads`` threads (the calls release the GIL). ``direct_io`` opens files with
  ``O_DIRECT`` when every address and size of a key is 4 KiB aligned (else buffered).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import itertools
import logging
import os
import shutil
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from kvray.backends.base import Backend, Check, KeyStatus, Pieces, Seal
from kvray.backends.blocking import BlockingCalls
from kvray.config import SsdConfig
from kvray.errors import ConfigError
from kvray.paths import check_dir

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MAGIC = b"KVRAYBLK"
VERSION = 2
_HEADER = struct.Struct("<8sHHQQQI8x")  # 48 bytes
ALIGN = 4096


@dataclass
class _Entry:
    path: Path
    payload: int
    offset: int
    crc: int
    seq: int


@dataclass
class SsdStats:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    corrupt: int = 0
    full: int = 0


def _views(ptrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    return [
        memoryview((ctypes.c_ubyte * n).from_address(p)).cast("B")
        for p, n in zip(ptrs, sizes, strict=True)
    ]


def _crc(views: Sequence[memoryview]) -> int:
    """xxh3-64 of the pieces in order (measured here: ~30 GB/s, zlib.crc32 ~4 GB/s)."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return int(h.intdigest())


def check_ssd_path(path: str, *, field: str = "ssd.path") -> Path:
    return check_dir(path, field=field)


class SsdBackend(Backend):
    """One rank's SSD tier."""

    name = "ssd"

    def __init__(self, config: SsdConfig, rank: int, *, save_niceness: int = 0) -> None:
        root = check_ssd_path(config.path)
        total = shutil.disk_usage(root).total
        if config.quota > total:
            raise ConfigError(
                f"ssd.quota is {config.quota} bytes per rank but the disk under {root} holds "
                f"{total} bytes: lower the quota"
            )
        self._config = config
        self.root = root / f"rank_{rank}"
        self._blocks = self.root / "blocks"
        self._tmp = self.root / "tmp"
        self._blocks.mkdir(parents=True, exist_ok=True)
        for shard in range(256):  # once, not a mkdir per write
            (self._blocks / f"{shard:02x}").mkdir(exist_ok=True)
        shutil.rmtree(self._tmp, ignore_errors=True)  # half-written blocks of a crash
        self._tmp.mkdir()
        self._lock = threading.Lock()
        self._direct_ok = True
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self._seq = 0
        self.stats = SsdStats()
        self.evicted: list[str] | None = None
        """When a list: the keys the quota evicts are added to it (for the block index)."""
        started = time.monotonic()
        self._rebuild()
        self._calls = BlockingCalls(
            "ssd tier", "ssd", config.io_threads, background_niceness=save_niceness
        )
        logger.info(
            "ssd tier %s: %d block(s), %d bytes indexed in %.0f ms (quota %d, eviction %s)",
            self.root,
            len(self._index),
            self._used,
            (time.monotonic() - started) * 1e3,
            config.quota,
            config.eviction,
        )

    # ---- index -----------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self._blocks / digest[:2] / f"{digest}.blk"

    def _rebuild(self) -> None:
        found: list[tuple[float, int, str, _Entry]] = []
        for path in self._blocks.glob("*/*.blk"):
            try:
                with open(path, "rb") as f:
                    head = f.read(_HEADER.size)
                    magic, ver, offset, payload, crc, seq, klen = _HEADER.unpack(head)
                    if magic != MAGIC or ver != VERSION:
                        raise ValueError("not a kvray block")
                    key = f.read(klen).decode()
                if path.stat().st_size != offset + payload or self._path(key) != path:
                    raise ValueError("truncated or misplaced")
            except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
                logger.warning("ssd tier: dropping unreadable block %s (%s)", path, exc)
                path.unlink(missing_ok=True)
                continue
            entry = _Entry(path, payload, offset, crc, seq)
            order = path.stat().st_mtime if self._config.eviction == "lru" else float(seq)
            found.append((order, seq, key, entry))
        for _, _, key, entry in sorted(found):
            self._index[key] = entry
            self._used += entry.offset + entry.payload
            self._seq = max(self._seq, entry.seq)

    def _offset(self, key: bytes, payload: int) -> int:
        """Where the payload starts: page aligned for direct I/O and for blocks of 64 KiB
        or more (measured: page-aligned payloads write ~40 % faster through the page
        cache); small blocks keep the compact header."""
        if self._config.direct_io or payload >= 64 << 10:
            return ALIGN * -(-(_HEADER.size + len(key)) // ALIGN)
        return _HEADER.size + len(key)

    def _make_room(self, need: int) -> bool:
        """Evict until ``need`` more bytes fit (called under the lock)."""
        quota = self._config.quota
        if need > quota:
            return False
        while self._used + need > quota:
            if self._config.eviction == "none" or not self._index:
                return False
            key, entry = self._index.popitem(last=False)
            self._used -= entry.offset + entry.payload
            entry.path.unlink(missing_ok=True)
            self.stats.evictions += 1
            if self.evicted is not None:
                self.evicted.append(key)
        return True

    # ---- I/O (worker threads) ----------------------------------------------------------

    def _open(self, path: Path, flags: int, direct: bool) -> int:
        """``os.open``, with ``O_DIRECT`` where asked and the filesystem allows it (tmpfs
        refuses it with EINVAL: then buffered I/O, once logged)."""
        if direct and self._direct_ok:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_ok = False
                logger.warning("ssd tier: %s does not support O_DIRECT; using buffered I/O", path)
        return os.open(path, flags, 0o644)

    def _aligned(self, ptrs: Sequence[int], sizes: Sequence[int]) -> bool:
        return (
            self._direct_ok
            and self._config.direct_io
            and all(p % ALIGN == 0 and n % ALIGN == 0 for p, n in zip(ptrs, sizes, strict=True))
        )

    def _write_one(
        self, key: str, ptrs: Sequence[int], sizes: Sequence[int], ow: bool
    ) -> KeyStatus:
        with self._lock:
            if key in self._index and not ow:
                return KeyStatus.OK  # first write wins
            self._seq += 1
            seq = self._seq
        kb = key.encode()
        payload = sum(sizes)
        offset = self._offset(kb, payload)
        views = _views(ptrs, sizes)
        crc = _crc(views)
        header = _HEADER.pack(MAGIC, VERSION, offset, payload, crc, seq, len(kb)) + kb
        header += b"\0" * (offset - len(header))
        final = self._path(key)
        tmp = self._tmp / f"{final.name}.{threading.get_ident()}.{seq}"
        direct = self._aligned(ptrs, sizes)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._used -= old.offset + old.payload
            if not self._make_room(offset + payload):
                self.stats.full += 1
                if old is not None:
                    old.path.unlink(missing_ok=True)
                return KeyStatus.POOL_FULL
            self._used += offset + payload  # reserved; released if the write fails
        try:
            fd = self._open(tmp, flags, direct)
            direct = direct and self._direct_ok
            try:
                if direct:
                    # O_DIRECT needs an aligned header buffer too: write it separately.
                    buf = ctypes.create_string_buffer(offset + ALIGN)
                    base = (ctypes.addressof(buf) + ALIGN - 1) // ALIGN * ALIGN
                    ctypes.memmove(base, header, offset)
                    os.pwrite(fd, _views([base], [offset])[0], 0)
                    os.pwritev(fd, views, offset)
                else:
                    os.pwritev(fd, [header, *views], 0)
                if self._config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._used -= offset + payload
            logger.warning("ssd tier: write of a block failed: %s", exc)
            return KeyStatus.ERROR
        with self._lock:
            prev = self._index.pop(key, None)  # a concurrent writer of the same key won
            if prev is not None:
                self._used -= prev.offset + prev.payload
            self._index[key] = _Entry(final, payload, offset, crc, seq)
            self.stats.bytes_written += payload
        return KeyStatus.OK

    def _read_one(self, key: str, ptrs: Sequence[int], sizes: Sequence[int]) -> KeyStatus:
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and self._config.eviction == "lru":
                self._index.move_to_end(key)
        if entry is None:
            self.stats.misses += 1
            return KeyStatus.NOT_FOUND
        if entry.payload != sum(sizes):
            return KeyStatus.SIZE_MISMATCH
        views = _views(ptrs, sizes)
        direct = self._aligned(ptrs, sizes) and entry.offset % ALIGN == 0
        try:
            fd = self._open(entry.path, os.O_RDONLY, direct)
            try:
                got = os.preadv(fd, views, entry.offset)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._forget(key, entry)
            self.stats.misses += 1
            return KeyStatus.NOT_FOUND
        except OSError as exc:
            logger.warning("ssd tier: read of a block failed: %s", exc)
            return KeyStatus.TRANSFER_FAILED
        if got != entry.payload or _crc(views) != entry.crc:
            logger.warning("ssd tier: block %s fails its checksum: removed", entry.path)
            self.stats.corrupt += 1
            self._forget(key, entry)
            entry.path.unlink(missing_ok=True)
            return KeyStatus.NOT_FOUND
        if self._config.eviction == "lru":
            os.utime(entry.path)  # the order survives a restart
        self.stats.hits += 1
        self.stats.bytes_read += entry.payload
        return KeyStatus.OK

    def keys(self) -> list[str]:
        """Every key the tier holds now."""
        with self._lock:
            return list(self._index)

    def take_evicted(self) -> list[str]:
        """The keys evicted since the last call (with :attr:`evicted` set)."""
        with self._lock:
            if not self.evicted:
                return []
            keys, self.evicted = self.evicted, []
            return keys

    def _forget(self, key: str, entry: _Entry) -> None:
        with self._lock:
            if self._index.get(key) is entry:
                del self._index[key]
                self._used -= entry.offset + entry.payload

    # ---- contract --------------------------------------------------------------------

    async def _each(
        self, fn: Callable[..., _T], *cols: Sequence[Any], background: bool = False
    ) -> list[_T]:
        """``fn`` per row of ``cols``, on the tier's threads (``background``: its write
        threads): one call per thread, each over a contiguous slice of the rows, so that a
        batch wakes the event loop ``io_threads`` times, not once per block (measured:
        256 writes of 1 MiB as a call each scaled 1.3x from one thread to four, where raw
        writes in slices scale 2x)."""
        call = self._calls.background if background else self._calls
        rows = list(zip(*cols, strict=True))
        n, k = len(rows), min(self._config.io_threads, len(rows))
        bounds = [n * i // k for i in range(k + 1)] if k else [0]

        def run(lo: int, hi: int) -> list[_T]:
            return [fn(*row) for row in rows[lo:hi]]

        parts = await asyncio.gather(*(call(run, a, b) for a, b in itertools.pairwise(bounds)))
        return [out for part in parts for out in part]

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    async def put(
        self,
        keys: Sequence[str],
        ptrs: Pieces,
        sizes: Pieces,
        *,
        overwrite: bool = False,
        seal: Seal | None = None,
    ) -> list[KeyStatus]:
        if seal is None:
            return await self._each(
                self._write_one, keys, ptrs, sizes, [overwrite] * len(keys), background=True
            )

        def seal_and_write(i: int, key: str, p: Sequence[int], s: Sequence[int]) -> KeyStatus:
            seal(i, i + 1)
            return self._write_one(key, p, s, overwrite)

        return await self._each(
            seal_and_write, range(len(keys)), keys, ptrs, sizes, background=True
        )

    async def get(
        self, keys: Sequence[str], ptrs: Pieces, sizes: Pieces, *, check: Check | None = None
    ) -> list[KeyStatus]:
        if check is None:
            return await self._each(self._read_one, keys, ptrs, sizes)

        def read_and_check(i: int, key: str, p: Sequence[int], s: Sequence[int]) -> KeyStatus:
            status = self._read_one(key, p, s)
            return check(i, i + 1, [status])[0] if status is KeyStatus.OK else status

        return await self._each(read_and_check, range(len(keys)), keys, ptrs, sizes)

    async def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyStatus]:
        out = []
        with self._lock:
            for k in keys:
                entry = self._index.pop(k, None)
                if entry is None:
                    out.append(KeyStatus.NOT_FOUND)
                    continue
                self._used -= entry.offset + entry.payload
                entry.path.unlink(missing_ok=True)
                out.append(KeyStatus.OK)
        return out

    async def register_region(self, ptr: int, size: int) -> None:
        """Nothing to register: files are read and written from the addresses directly."""

    async def unregister_region(self, ptr: int) -> None:
        """See :meth:`register_region`."""

    async def health(self) -> bool:
        return not self._calls.closed and os.access(self.root, os.W_OK)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"blocks": len(self._index), "used_bytes": self._used}

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "segment": f"ssd {self.root}",
            "segment_bytes": self._config.quota,
            "eviction": self._config.eviction,
            **self.usage(),
            "stats": dict(self.stats.__dict__),
        }

    async def close(self) -> None:
        await self._calls.close()
