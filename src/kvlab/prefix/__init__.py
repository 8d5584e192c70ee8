"""Stage 6: automatic prefix caching on the paged block pool.

A request whose prompt starts like an earlier one (a shared system prompt, few-shot examples, the
history of a multi-turn chat) need not compute that prefix again: its K/V is still in the pool.
Full blocks are found by a hash chained through the parent block (vLLM v1's automatic prefix
caching), confirmed against their token ids, shared by ref count, and evicted least recently used
first through the stage-4 free block queue. SGLang's RadixAttention does the same with a radix
tree of token runs.

Modules, in reading order:

* `block_hash`: `hash_block`, `hash_full_blocks`, `extra_keys_for` (cache_salt), SHA-256.
* `prefix_cache`: `PrefixCache` (hash -> block, exact check), `CachingBlockPool` (LRU eviction).
* `manager`: `PrefixCachingKVCacheManager(KVCacheManager)`: the lookup, caching the blocks it
  fills; `views`: its statistics (hit rate, blocks saved, prefill tokens skipped, evictions).
* `trace_blocks`: how the manager reads a request's tokens: real ids, or simulation's stand-ins.
* `trace_hit_rate`: the same manager replayed on the Mooncake traces' block hashes, no tensors.
* `workloads`: shared-prefix prompts for the tiny model; `chats`: real-text multi-turn chats.
* `report_row`: the `paged+prefix` row of `kvlab report` on a Mooncake trace.

The scheduler of `kvlab.serving` calls this manager directly, as it calls stage 4's
(`LLMEngine(..., enable_prefix_caching=True)`; `generate(..., cache="prefix")` and so `kvlab
generate --cache prefix`): prefill starts after the hit (vLLM's num_computed_tokens).
"""

from .block_hash import (ROOT_HASH, extra_keys_for, hash_block, hash_full_blocks, sha256, short)
from .manager import PrefixCachingKVCacheManager
from .prefix_cache import CachedBlock, CachingBlockPool, PrefixCache
from .views import PrefixCacheStats

__all__ = [
    "ROOT_HASH", "sha256", "extra_keys_for", "hash_block", "hash_full_blocks", "short",
    "CachedBlock", "PrefixCache", "CachingBlockPool", "PrefixCacheStats",
    "PrefixCachingKVCacheManager",
]
