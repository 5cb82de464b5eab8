"""A native client's segment mapped before stores write it.

Mooncake allocates a client's segment and leaves its pages unmapped until a store first
writes them, so every page of a store into fresh segment memory is a page fault (the
kernel zeroes the page, then the store copies over it). Measured on a 2-core host: a
64 MiB put into a fresh segment took 37-45 ms of CPU and 16,400 faults, 19 ms and none
once the segment was mapped. The pool keeps filling its segments for hours after a
start, and those faults run beside the engines' forwards.

:class:`SegmentWarmer` maps the pages with ``madvise(MADV_POPULATE_WRITE)`` on a thread of
its own after the client is up, in small chunks, paced to a tenth of a core. A page that
is already mapped, or that a store writes meanwhile, is left as it is: populating maps
missing pages and never changes bytes. The segment is found as the anonymous memory the
client's setup mapped (:func:`anonymous_ranges` before and after).

The thread keeps the process's scheduling priority. While it maps a chunk it holds the
process's memory-map lock, which every other thread that maps or unmaps memory (an
allocator, Ray's threads) then waits for. At idle priority it held that lock for as long
as a busy host left it without a core: seen as a pool's client that answered no store for
over a minute under a loaded soak. Small chunks at the process's priority hold it for well
under a millisecond of work; the pace keeps the thread off the engines' cores.

Mapping ahead commits the segment's memory at start instead of as it fills. It starts
only when the segment fits in the host's available memory, and it stops, the rest left to
the stores, when the host's available memory falls below a fifth of its total (clients
that start together, engines that grow beside them).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from pathlib import Path

from kvray.findings import mem_available, mem_total

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""Linux 5.14 and later."""
CHUNK = 2 << 20
"""Bytes mapped per call: the memory-map lock is held for one (a fraction of a millisecond
of work), and a stop waits for at most one."""
DUTY = 0.1
"""The share of one core the thread takes: after each chunk it sleeps nine times as long as
the chunk took (a 4 GiB segment: about 15 s on an idle 2-core host)."""
MIN_RANGE = 16 << 20
"""Smaller new mappings (thread stacks, allocator arenas) are not the segment."""
HEADROOM = 0.9
"""The segment is mapped only if it fits in this share of the host's available memory at
start; beyond that, mapping it now could push the host into the OOM killer."""
FLOOR = 0.2
"""Mapping stops, the rest left to the stores, once the host's available memory falls
below this share of its total: several clients start at once and each one's start check
sees the memory the others have not mapped yet, and the engines beside them still grow."""
CHECK_EVERY = 32
"""Chunks mapped between two reads of the host's available memory (64 MiB)."""

Range = tuple[int, int]


def anonymous_ranges(maps: Path = Path("/proc/self/maps")) -> list[Range]:
    """The process's private, writable, anonymous mappings, as ``[start, end)``."""
    out: list[Range] = []
    for line in maps.read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 or fields[1] != "rw-p":  # (a path, or [heap] / [stack])
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append((lo, hi))
    return out


def new_ranges(before: list[Range], after: list[Range], min_bytes: int = MIN_RANGE) -> list[Range]:
    """The parts of ``after`` not in ``before`` (a new mapping may have merged with an old
    neighbour), each at least ``min_bytes``, largest first."""
    out: list[Range] = []
    old = sorted(before)
    for lo, hi in sorted(after):
        pieces = [(lo, hi)]
        for a, b in old:
            if b <= lo or a >= hi:
                continue
            pieces = [p for x, y in pieces for p in ((x, min(y, a)), (max(x, b), y)) if p[0] < p[1]]
        out += [p for p in pieces if p[1] - p[0] >= min_bytes]
    return sorted(out, key=lambda r: r[0] - r[1])


class SegmentWarmer:
    """Maps ``ranges`` in the background, paced to :data:`DUTY` of a core; :meth:`stop`
    before the memory is freed."""

    def __init__(self, ranges: list[Range], what: str) -> None:
        self.ranges = ranges
        self.what = what
        self.total = sum(hi - lo for lo, hi in ranges)
        self.mapped = 0
        self.seconds = 0.0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvray-segment-warmer", daemon=True)

    @classmethod
    def start(cls, ranges: list[Range], what: str) -> SegmentWarmer | None:
        """Start mapping ``ranges`` (None: nothing to map, or no room to map it)."""
        total = sum(hi - lo for lo, hi in ranges)
        if not total:
            return None
        avail = mem_available()
        if avail is not None and total > HEADROOM * avail:
            logger.warning(
                "%s: not mapping its %d MiB segment ahead of stores: the host has %d MiB "
                "available; stores map its pages as they write them",
                what, total >> 20, avail >> 20,
            )  # fmt: skip
            return None
        warmer = cls(ranges, what)
        warmer._thread.start()
        return warmer

    def _memory_low(self, host: int | None) -> bool:
        """The host's available memory is below :data:`FLOOR` of ``host``, its total
        (logged: the warmer stops there)."""
        avail = mem_available()
        if avail is None or host is None or avail >= FLOOR * host:
            return False
        logger.warning(
            "%s: stopped mapping its segment ahead of stores at %d of %d MiB: the host's "
            "available memory fell to %d of %d MiB; stores map the rest as they write it",
            self.what, self.mapped >> 20, self.total >> 20, avail >> 20, host >> 20,
        )  # fmt: skip
        return True

    def _run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        started = time.monotonic()
        pause = (1 - DUTY) / DUTY
        host = mem_total()
        try:
            chunks = 0
            for lo, hi in self.ranges:
                for at in range(lo, hi, CHUNK):
                    if chunks % CHECK_EVERY == 0 and self._memory_low(host):
                        return
                    chunks += 1
                    n = min(CHUNK, hi - at)
                    t0 = time.monotonic()
                    while madvise(at, n, MADV_POPULATE_WRITE) != 0:
                        err = ctypes.get_errno()
                        if err == errno.EINTR:
                            continue
                        if err == errno.EINVAL:  # (a kernel older than 5.14)
                            logger.info("%s: this kernel cannot map a segment ahead of "
                                        "stores (MADV_POPULATE_WRITE)", self.what)  # fmt: skip
                        else:  # ENOMEM: unmapped meanwhile (closing)
                            logger.warning("%s: mapping its segment stopped: %s",
                                           self.what, os.strerror(err))  # fmt: skip
                        return
                    self.mapped += n
                    if self._stop.wait((time.monotonic() - t0) * pause):
                        return
        finally:
            self.seconds = time.monotonic() - started
            self.done.set()
            if self.mapped == self.total:
                logger.info("%s: segment mapped ahead of stores (%d MiB in %.1f s)",
                            self.what, self.total >> 20, self.seconds)  # fmt: skip

    def stop(self) -> None:
        """Stop mapping and wait for the call in progress (before the memory is freed)."""
        self._stop.set()
        self._thread.join()
