"""Checks of directories users hand to kvray (SSD tiers, offload paths)."""

from __future__ import annotations

import os
from pathlib import Path

from kvray.errors import ConfigError


def check_dir(path: str, *, field: str) -> Path:
    """Absolute, existing, writable, no ``..`` and no symlink on the way: else a
    :class:`ConfigError` naming ``field`` and the fix."""
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts:
        raise ConfigError(f"{field}: must be an absolute path without '..', got {path!r}")
    if not p.is_dir():
        raise ConfigError(f"{field}: {path!r} does not exist or is not a directory: create it")
    if any(Path(*p.parts[: i + 1]).is_symlink() for i in range(1, len(p.parts))):
        raise ConfigError(f"{field}: {path!r} goes through a symlink: give the real path")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: {path!r} is not writable by this process")
    return p
