"""Shared-memory regions: memory a client process and its rank's BackendClient actor both
map, so KV bytes move with the backend's zero-copy calls and never through Ray.

A region is an anonymous memory file (``memfd_create``), never a name under ``/dev/shm``:
the kernel frees it when the last process holding it (its creator's descriptor, every
mapping) is gone, however that process ended. A SIGKILLed, OOM-killed or drained engine
cannot leave its KV cache behind as a file (a named ``/dev/shm`` file outlived every
engine that died without running its exit handlers: a KV-cache-sized leak per restart).

Other processes on the same node attach through the creator's descriptor,
``/proc/<pid>/fd/<fd>``, checked against the file's inode (so a reused pid or descriptor
number is never mistaken for the region) and against the node identity (so a process on
another node, which may share this kernel in a namespaced test harness, is refused as it
would be on real hardware). An attaching process keeps its mapping until it sees that the
creator is gone (:meth:`SharedRegion.stale`) and drops it;
:class:`~kvray.store.rank_store.RankStore` sweeps for that every few seconds.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvray.errors import RegionError

SHM_DIR = Path("/dev/shm")
_counter = itertools.count()


@functools.cache
def node_identity() -> str:
    """Which node's memory a region lives in: the kernel's boot id and the device of
    ``/dev/shm`` (processes of one node that can share memory see the same pair; nodes of
    the multi-node test harness share a kernel but each mounts its own ``/dev/shm``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        shm_dev = os.stat(SHM_DIR).st_dev
    except OSError:
        shm_dev = 0
    return f"{boot}:{shm_dev}"


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """Enough to map a region from another process on the same node."""

    region_id: str
    path: str
    """``/proc/<owner_pid>/fd/<fd>``: the creator's descriptor of the memory file."""
    size: int
    owner_pid: int
    inode: int
    """The memory file's inode: tells the region apart from whatever reuses the path."""
    node: str
    """:func:`node_identity` of the creator."""


class SharedRegion:
    """One mapped shared-memory region (created here or attached)."""

    def __init__(self, spec: RegionSpec, array: np.ndarray, *, owner_fd: int | None = None) -> None:
        self.spec = spec
        self._array: np.ndarray | None = array
        self._base: int = array.__array_interface__["data"][0]
        self._owner_fd = owner_fd

    @classmethod
    def create(cls, prefix: str, size: int) -> SharedRegion:
        """Create a zero-filled region of ``size`` bytes named ``<prefix>-<pid>-<n>``
        (the name shows in ``/proc/<pid>/maps`` as ``/memfd:<name>``)."""
        if size <= 0:
            raise RegionError(f"region size must be > 0, got {size}")
        pid = os.getpid()
        region_id = f"{prefix}-{pid}-{next(_counter)}"
        fd = os.memfd_create(region_id, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)  # memory files start zeroed
            array = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        spec = RegionSpec(region_id, f"/proc/{pid}/fd/{fd}", size, pid, inode, node_identity())
        return cls(spec, array, owner_fd=fd)

    @classmethod
    def attach(cls, spec: RegionSpec, *, populate: bool = False) -> SharedRegion:
        """Map the region ``spec`` names. ``populate`` maps every page now
        (``MAP_POPULATE``, ~0.1 s per GiB): a page first touched by this process later
        costs a fault in the middle of a transfer (measured: a 14 MiB copy into pages
        new to the process took 7.6 ms, 1.5 ms once mapped)."""
        if spec.node != node_identity():
            raise RegionError(
                f"region {spec.region_id} was created on another node than this process's: "
                "the BackendClient actor must run on the same node as the process that "
                "created it (use the client of that process's own node)"
            )
        try:
            fd = os.open(spec.path, os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise RegionError(
                f"region {spec.region_id} is gone: its creator (pid {spec.owner_pid}) "
                "exited or closed it"
            ) from exc
        except PermissionError as exc:
            raise RegionError(
                f"region {spec.region_id}: may not open {spec.path}; the BackendClient "
                "actor must run as the same user as the engine that created it"
            ) from exc
        try:
            st = os.fstat(fd)
            if st.st_ino != spec.inode:
                raise RegionError(
                    f"region {spec.region_id} is gone: {spec.path} now names another file"
                )
            if st.st_size < spec.size:
                raise RegionError(
                    f"region {spec.region_id} is {st.st_size} bytes, descriptor says {spec.size}"
                )
            # mmap keeps its own duplicate of the descriptor for as long as it is mapped.
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            array = np.frombuffer(mmap.mmap(fd, spec.size, flags=flags), dtype=np.uint8)
        finally:
            os.close(fd)
        return cls(spec, array)

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise RegionError(f"region {self.spec.region_id} is closed")
        return self._array

    @property
    def base_ptr(self) -> int:
        """The mapping's address (read once: a client asks it per value it moves)."""
        if self._array is None:
            raise RegionError(f"region {self.spec.region_id} is closed")
        return self._base

    def stale(self) -> bool:
        """True when the creator closed the region or died: the mapping can be dropped."""
        try:
            return os.stat(self.spec.path).st_ino != self.spec.inode
        except (FileNotFoundError, ProcessLookupError):
            return True
        except PermissionError:
            return False

    def close(self) -> None:
        """Drop this process's hold. Views handed out keep the mapping alive until they
        go; the memory is freed once no process holds it."""
        if self._array is None:
            return
        self._array = None
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs: none exists, or it exited and its parent has not
    reaped it yet (a zombie: a killed Ray worker until its raylet reaps it). One we may
    not signal counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def remove_leftovers(prefix: str, *, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink ``/dev/shm`` files named ``<prefix>[-<tag>]-<pid>-<n>`` whose owner process
    is gone: what kvray versions before memory-file regions left when killed."""
    removed = []
    for path in shm_dir.glob(f"{prefix}-*"):
        parts = path.name.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        if not process_gone(int(parts[1])):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def mapped_regions(prefix: str = "kvray-") -> dict[int, list[str]]:
    """Regions whose name starts with ``prefix``, by the pid of each process mapping one
    (read from ``/proc/*/maps``, where a region shows as ``/memfd:<name> (deleted)``)."""
    found: dict[int, list[str]] = {}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        names = {
            line[at + len("/memfd:") :].removesuffix(" (deleted)")
            for line in text.splitlines()
            if (at := line.find(f"/memfd:{prefix}")) >= 0
        }
        if names:
            found[int(maps.parent.name)] = sorted(names)
    return found


def orphaned_mappings(prefix: str = "kvray-") -> dict[int, list[str]]:
    """Mapped regions whose creator is gone: what a leak of a dead engine's KV cache looks
    like (``<prefix>...-<creator pid>-<n>``)."""
    found: dict[int, list[str]] = {}
    for pid, names in mapped_regions(prefix).items():
        dead = [n for n in names if creator_gone(n)]
        if dead:
            found[pid] = dead
    return found


def creator_gone(region_id: str) -> bool:
    """Whether the process that created region ``region_id`` (by its name) is gone."""
    parts = region_id.rsplit("-", 2)
    return len(parts) == 3 and parts[1].isdigit() and process_gone(int(parts[1]))
