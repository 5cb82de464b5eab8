"""What decides an instance's block hashes beyond its key space (namespace, layout, TP, PP,
which are in the keys themselves): vLLM's prefix-caching hash algorithm and the seed of
the first block's parent hash (vLLM's ``NONE_HASH``: from ``PYTHONHASHSEED`` when set,
else a fixed default for the sha256 algorithms and random bytes per process for the
non-cryptographic xxhash ones). Two instances that differ here derive different hashes
for the same tokens and never share a block, silently: kvray names both sides instead.

The *hash domain* is a short digest of the algorithm and ``NONE_HASH``: equal domains hash
alike. It is compared at attach (the pool remembers the domains each model was stored
under) and between a PD prefill and its decode (``kv_transfer_params``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from typing import Any

NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


@dataclass(frozen=True)
class Fingerprint:
    hash_algo: str
    seed_source: str
    """``PYTHONHASHSEED``, ``vLLM default`` or ``random per process``."""
    hash_domain: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.hash_algo} seeded by {self.seed_source} (hash domain {self.hash_domain})"


def seed_source(algo: str, environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get("PYTHONHASHSEED") is not None:
        return "PYTHONHASHSEED"
    return "random per process" if algo in NON_CRYPTO_ALGOS else "vLLM default"


def fingerprint(
    algo: str, none_hash: bytes | int, environ: dict[str, str] | None = None
) -> Fingerprint:
    raw = none_hash if isinstance(none_hash, bytes) else str(none_hash).encode()
    domain = hashlib.sha256(algo.encode() + b"\0" + raw).hexdigest()[:16]
    return Fingerprint(algo, seed_source(algo, environ), domain)


def current(algo: str) -> Fingerprint | None:
    """This engine's, once vLLM has set ``NONE_HASH`` (its EngineCore does so after making
    the scheduler, so the connector asks at the first request), else None."""
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None
    return fingerprint(algo, none_hash)


FIX = (
    "set the same PYTHONHASHSEED (any fixed value) and the same --prefix-caching-hash-algo on "
    "every instance that should share blocks"
)


def mismatch_message(model: str, mine: Fingerprint, others: list[dict[str, Any]]) -> str:
    theirs = "; ".join(
        f"{o.get('hash_algo')} seeded by {o.get('seed_source')} (hash domain "
        f"{o.get('hash_domain')}, {o.get('instances', 1)} instance(s))"
        for o in others
    )
    return (
        f"blocks of model {model!r} in this pool were hashed differently: this instance uses "
        f"{mine.describe()}, earlier ones {theirs}. Instances of different hash domains never "
        f"hit each other's blocks: {FIX}"
    )


def random_seed_message(mine: Fingerprint) -> str:
    return (
        f"vLLM hashes blocks with {mine.hash_algo} and no PYTHONHASHSEED: its seed is random "
        "per process, so no other instance (nor this one after a restart) will ever hit the "
        f"blocks it stores: {FIX}"
    )
