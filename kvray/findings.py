"""What ``kvray doctor`` reports: a :class:`Finding` (what, why and the fix), and the
:class:`Host` facts the checks read. A leaf: the backend checks (kvray/backends/checks.py)
and the doctor (kvray/doctor.py) both build on it."""

from __future__ import annotations

import glob
import resource
import shutil
from dataclasses import dataclass
from typing import Literal

Level = Literal["error", "warning", "ok"]


@dataclass(frozen=True)
class Finding:
    level: Level
    check: str
    what: str
    why: str = ""
    fix: str = ""

    def line(self) -> str:
        parts = [f"[{self.level.upper():7}] {self.check}: {self.what}"]
        if self.why:
            parts.append(f"          why: {self.why}")
        if self.fix:
            parts.append(f"          fix: {self.fix}")
        return "\n".join(parts)


def _meminfo(field: str) -> int | None:
    """``field`` of /proc/meminfo in bytes (None: not known)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_available() -> int | None:
    """The host's available memory in bytes (``MemAvailable``; None: not known)."""
    return _meminfo("MemAvailable")


def mem_total() -> int | None:
    """The host's memory in bytes (``MemTotal``; None: not known)."""
    return _meminfo("MemTotal")


@dataclass(frozen=True)
class Host:
    """What the checks read of this machine (tests pass their own)."""

    mem_available: int | None
    dev_shm_free: int | None
    memlock_limit: int | None
    """RLIMIT_MEMLOCK soft limit in bytes; None: unlimited."""
    npu: bool
    rdma: bool

    @classmethod
    def probe(cls) -> Host:
        mem = mem_available()
        try:
            shm: int | None = shutil.disk_usage("/dev/shm").free
        except OSError:
            shm = None
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return cls(
            mem_available=mem,
            dev_shm_free=shm,
            memlock_limit=None if soft == resource.RLIM_INFINITY else soft,
            npu=bool(glob.glob("/dev/davinci[0-9]*")),
            rdma=bool(glob.glob("/sys/class/infiniband/*")),
        )
