"""kvray: a distributed KV-cache pool for vLLM, as an asyncio actor runtime on Ray.

The public names load on first use (PEP 562), so that importing one of kvray's
subsystems (the routing proxy, the connector in a vLLM process) loads that subsystem
alone, not the Pool API and Ray with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads them
    from kvray.config import ConnectorConfig as ConnectorConfig
    from kvray.config import MooncakeConfig as MooncakeConfig
    from kvray.config import PoolConfig as PoolConfig
    from kvray.errors import KVRayError as KVRayError
    from kvray.keys import BlockKey as BlockKey
    from kvray.keys import KeySpace as KeySpace
    from kvray.keys import KVLayout as KVLayout
    from kvray.keys import chain_block_hashes as chain_block_hashes
    from kvray.pool import Pool as Pool

_WHERE = {
    "BlockKey": "kvray.keys",
    "ConnectorConfig": "kvray.config",
    "KVLayout": "kvray.keys",
    "KVRayError": "kvray.errors",
    "KeySpace": "kvray.keys",
    "MooncakeConfig": "kvray.config",
    "Pool": "kvray.pool",
    "PoolConfig": "kvray.config",
    "chain_block_hashes": "kvray.keys",
}

__all__ = [
    "BlockKey",
    "ConnectorConfig",
    "KVLayout",
    "KVRayError",
    "KeySpace",
    "MooncakeConfig",
    "Pool",
    "PoolConfig",
    "chain_block_hashes",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
