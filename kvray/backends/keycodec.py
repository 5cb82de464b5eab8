"""Fit kvray keys to a backend's key rules, deterministically and without collisions.

A key that already obeys the rules is kept as it is (readable in the backend's tools).
Any other key becomes its allowed characters (others replaced by ``_``), cut to fit,
plus ``%h`` and 32 hex digits of the sha256 of the *original* key. A kept key never
ends like that (such keys are rewritten too), so two different keys can only meet if
sha256 collides in 128 bits.

openYuanrong datasystem: at most 255 characters of ``[a-zA-Z0-9-_!@#%^*()+=:;]`` (its
``mset`` silently drops other keys, so kvray never sends one). MemCache: at most 256.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_SUFFIX_RE = re.compile(r"%h[0-9a-f]{32}$")
_DIGEST_HEX = 32


@dataclass(frozen=True)
class KeyRules:
    """What a backend accepts as a key."""

    max_len: int
    allowed: re.Pattern[str]
    """Matches one allowed character."""

    def __post_init__(self) -> None:
        # One compiled pass over the whole key: encode runs for every key of every batch.
        whole = re.compile(f"(?:{self.allowed.pattern})+")
        object.__setattr__(self, "_whole", whole)

    def fits(self, key: str) -> bool:
        whole: re.Pattern[str] = getattr(self, "_whole")  # noqa: B009  (set in __post_init__)
        return (
            len(key) <= self.max_len
            and whole.fullmatch(key) is not None
            and not _SUFFIX_RE.search(key)
        )

    def encode(self, key: str) -> str:
        if self.fits(key):
            return key
        digest = hashlib.sha256(key.encode()).hexdigest()[:_DIGEST_HEX]
        readable = "".join(c if self.allowed.fullmatch(c) else "_" for c in key)
        keep = self.max_len - len(digest) - 2
        return f"{readable[:keep]}%h{digest}"


YUANRONG = KeyRules(255, re.compile(r"[a-zA-Z0-9\-_!@#%^*()+=:;]"))
MEMCACHE = KeyRules(256, re.compile(r"[\x21-\x7e]"))
