"""Byte sizes as deployments write them: ``"1GB"``, ``"1024MB"``, ``"1048576KB"``,
``"1073741824B"``, ``"1073741824"`` or an int.

Units are binary (1 KB = 1024 B), as in Mooncake and vLLM-Ascend's KV Pool, and case
insensitive. Decimals are accepted when they name a whole number of bytes
("1.5GB"); anything else is rejected rather than silently rounded.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_size(value: int | str, *, field: str = "size") -> int:
    """Return ``value`` in bytes; raise ``ValueError`` naming ``field`` if it is not a size."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a size like '1GB' or an int of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"{field}: expected a size like '1GB' or an int of bytes, got {type(value).__name__}"
        )
    m = _SIZE_RE.match(value.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(
            f"{field}: cannot parse size {value!r}; write an int of bytes or a number with "
            "one of the units B, KB, MB, GB, TB (binary, e.g. '1GB' = 1073741824)"
        )
    try:
        number = Decimal(m.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{field}: invalid number in size {value!r}") from exc
    nbytes = number * _UNITS[m.group(2)]
    if nbytes != nbytes.to_integral_value():
        raise ValueError(f"{field}: size {value!r} is not a whole number of bytes")
    return int(nbytes)


def format_size(nbytes: int) -> str:
    """Human-readable binary size for logs and tables: ``format_size(1536) == '1.5 KiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
