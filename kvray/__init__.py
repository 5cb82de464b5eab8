"""kvray: a distributed KV-cache pool for vLLM, as an asyncio actor runtime on Ray."""

from kvray.config import ConnectorConfig, MooncakeConfig, PoolConfig
from kvray.errors import KVRayError
from kvray.keys import BlockKey, KeySpace, KVLayout, chain_block_hashes
from kvray.pool import Pool

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
