"""kvray's own SSD tier (pipeline ``<backend>|ssd``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from kvray.config._common import ByteSize, GiB, MiB, _Strict


class SsdConfig(_Strict):
    """kvray's SSD tier: per rank, blocks as checksummed files under ``<path>/rank_<N>/``."""

    path: str
    """Directory on the SSD (absolute, existing, writable, no symlinks or ``..``; checked
    on the node that writes it)."""
    quota: ByteSize = 64 * GiB
    """Bytes per rank (payload + headers); larger than the disk is an error."""
    eviction: Literal["none", "fifo", "lru"] = "lru"
    """When full: ``none`` reports the put as pool full, ``fifo`` drops the oldest
    written, ``lru`` the least recently read or written."""
    io_threads: int = Field(4, ge=1, le=64)
    """Blocks read or written concurrently."""
    direct_io: bool = False
    """``O_DIRECT`` for keys whose addresses and sizes are 4 KiB aligned."""
    fsync: bool = False
    """fsync each block before it becomes visible (survives power loss, slower). Without
    it a block is still whole or absent after a process crash."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        p = Path(v)
        if not p.is_absolute() or ".." in p.parts:
            raise ValueError(f"must be an absolute path without '..', got {v!r}")
        return v

    @field_validator("quota")
    @classmethod
    def _quota(cls, v: int) -> int:
        if v < MiB:
            raise ValueError(f"must be at least 1MB, got {v} bytes")
        return v
