"""KV metadata in plain Python: block hashing, the block pool, the prefix cache.

Imports neither torch nor model code; KV tensors live with the runner, addressed by block id.
"""

from servelm.kv.block_hash import BlockHash, extra_key_from_salt, hash_block, hash_block_tokens
from servelm.kv.block_pool import KVCacheEvent, KVCacheInvariantError, KVEventType, PrefixCacheStats
from servelm.kv.kv_cache_manager import ComputedBlocks, KVCacheManager

__all__ = [
    "BlockHash",
    "ComputedBlocks",
    "KVCacheEvent",
    "KVCacheInvariantError",
    "KVCacheManager",
    "KVEventType",
    "PrefixCacheStats",
    "extra_key_from_salt",
    "hash_block",
    "hash_block_tokens",
]
