"""Shared-memory regions: memory a client process and its rank's BackendClient actor both
map, so KV bytes move with the backend's zero-copy calls and never through Ray.

A region is a file under ``/dev/shm``. The creating process owns it (unlinks it on
``close``); other processes ``attach`` by :class:`RegionSpec`. Numpy's memmap keeps the
mapping alive as long as any view of it exists, so closing never invalidates a tensor a
caller still holds.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvray.errors import RegionError

SHM_DIR = Path("/dev/shm")
_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """Enough to map a region from another process on the same node."""

    region_id: str
    path: str
    size: int
    owner_pid: int


class SharedRegion:
    """One mapped shared-memory region (created here or attached)."""

    def __init__(self, spec: RegionSpec, array: np.memmap, *, owner: bool) -> None:
        self.spec = spec
        self._array: np.memmap | None = array
        self._owner = owner

    @classmethod
    def create(cls, prefix: str, size: int, *, shm_dir: Path = SHM_DIR) -> SharedRegion:
        """Create a zero-filled region of ``size`` bytes named ``<prefix>-<pid>-<n>``."""
        if size <= 0:
            raise RegionError(f"region size must be > 0, got {size}")
        region_id = f"{prefix}-{os.getpid()}-{next(_counter)}"
        path = shm_dir / region_id
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        array = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        return cls(RegionSpec(region_id, str(path), size, os.getpid()), array, owner=True)

    @classmethod
    def attach(cls, spec: RegionSpec) -> SharedRegion:
        try:
            actual = os.stat(spec.path).st_size
        except FileNotFoundError as exc:
            raise RegionError(
                f"region {spec.region_id} ({spec.path}) does not exist on this node: the "
                "BackendClient actor must run on the same node as the process that created it"
            ) from exc
        if actual < spec.size:
            raise RegionError(
                f"region {spec.region_id} is {actual} bytes, descriptor says {spec.size}"
            )
        array = np.memmap(spec.path, dtype=np.uint8, mode="r+", shape=(spec.size,))
        return cls(spec, array, owner=False)

    @property
    def array(self) -> np.memmap:
        if self._array is None:
            raise RegionError(f"region {self.spec.region_id} is closed")
        return self._array

    @property
    def base_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def stale(self) -> bool:
        """True when the owner removed the file or died: the mapping can be dropped."""
        if not os.path.exists(self.spec.path):
            return True
        try:
            os.kill(self.spec.owner_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def close(self) -> None:
        if self._array is None:
            return
        self._array = None  # views handed out keep the mapping alive until they go
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spec.path)


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (one we may not signal counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_leftovers(prefix: str, *, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink regions named ``<prefix>[-<tag>]-<pid>-<n>`` whose owner process is gone."""
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
