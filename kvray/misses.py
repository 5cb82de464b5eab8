"""Why a block the engine asked the pool for was not loaded: one name per reason, used
by the connector's stats, vLLM's ``/metrics``, the pool's counters and ``kvray status``.

A lookup's missed blocks (those after its leading hits) all count under the reason of
the first one, which is what ended the prefix, except ``not_worth_loading``, which
counts the hit blocks the engine computed instead (the blocks after them keep their
reason; the pool counted them among its hits too). Load-time reasons count blocks that were
hits at lookup, per rank that failed to load them.
"""

from __future__ import annotations

LOOKUP_REASONS = {
    "not_stored": "never stored (or stored before what the pool's ledger remembers)",
    "evicted": "stored, then gone without kvray removing it: evicted by the backend, or "
    "lost with the memory of a client that left",
    "removed": "removed through kvray (Pool.remove)",
    "partial_ranks": "stored by some of the instance's ranks (or layer groups) only",
    "other_fingerprint": "never stored under this engine's block hashes, while the pool "
    "has instances of the same model that hash blocks differently (PYTHONHASHSEED, "
    "--prefix-caching-hash-algo)",
    "lookup_timeout": "the lookup took longer than lookup_timeout_ms",
    "lookup_error": "the lookup failed",
    "not_worth_loading": "held by the pool, but measured to load slower than computing "
    "its tokens: computed (recompute_slow_hits)",
}
LOAD_REASONS = {
    "gone_at_load": "a hit at lookup, gone at load (its read lease expired and it was "
    "evicted, or it was removed)",
    "load_failed": "a hit whose load failed (transfer error or timeout); at lookup, the "
    "blocks a retried request does not take again after its load of them failed",
    "corrupt": "a hit whose bytes failed their checksum on load (the block is removed)",
}
REASONS = {**LOOKUP_REASONS, **LOAD_REASONS}


def counter(reason: str) -> str:
    """The counter of ``reason`` (``miss_<reason>``)."""
    if reason not in REASONS:
        raise ValueError(f"unknown miss reason {reason!r}: one of {', '.join(REASONS)}")
    return f"miss_{reason}"
