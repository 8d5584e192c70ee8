"""Stage 4: the paged KV cache (vLLM's PagedAttention memory manager, Kwon et al., SOSP 2023).

The pool is cut into fixed-size blocks; a sequence's block table maps its logical blocks to any
physical blocks; blocks are taken only when a sequence crosses a block boundary and returned when it
finishes; forks share blocks by ref count and copy on write; when the pool runs dry the newest
sequence is preempted and recomputed later.

One module per idea, in reading order:

* `block_pool`: `Block`, `BlockPool` (a free block queue + ref counts; no tensors).
* `block_table`: `BlockTable` (logical -> physical blocks, slot = block_id * block_size + offset).
* `kv_cache_manager`: `KVCacheManager`, keyed by the request (vLLM v1's verbs, copy-on-write).
* `torch_attention`: write K/V by slot mapping; gather + attend (the plain-PyTorch teaching path).
* `backends`: `AttentionBackend`, `TorchBackend`, `BACKENDS` (where stage 5's kernel plugs in).
* `paged_cache`: `PagedKVCache` (the pool tensors, the KV stores a model runs on, exact bytes).
* `budget`: `num_blocks_for_budget`, `check_pool_fits` (vLLM's start-up arithmetic).
* `fragmentation`: external fragmentation, drawn as a string (`gaps_of`, `first_fit`, `place`).
* `free_queue`: `FreeBlockQueue` (doubly linked, O(1) pop / append / remove), which stage 6's
  prefix cache needs: a hit takes a freed block out of the middle of the queue.

What runs requests over the pool (admission, preemption, forks, sampling) is the one scheduler of
`kvlab.serving`: `LLMEngine` for a batch, `serve` for traffic arriving over time.
"""

from ..errors import KVCacheOutOfMemory, NoFreeBlocksError, RequestTooLongError
from ..lazy_import import on_first_use
from .block_pool import Block, BlockPool
from .block_table import BlockTable, cdiv
from .budget import check_pool_fits, kv_block_bytes, num_blocks_for_budget
from .free_queue import FreeBlockQueue
from .kv_cache_manager import KVCacheManager

# The tensors' modules load when first used: the block bookkeeping above needs no torch.
__getattr__, __dir__ = on_first_use(__name__, {
    "backends": ("BACKENDS", "AttentionBackend", "TorchBackend", "resolve_backend"),
    "paged_cache": ("PagedBatchStore", "PagedKVCache"),
    "torch_attention": ("gather_kv", "paged_decode_attention", "paged_prefill_attention",
                        "write_kv"),
})

__all__ = [
    "Block", "FreeBlockQueue", "BlockPool", "BlockTable", "cdiv", "KVCacheManager",
    "PagedKVCache", "PagedBatchStore", "write_kv", "gather_kv",
    "paged_prefill_attention", "paged_decode_attention", "kv_block_bytes", "num_blocks_for_budget",
    "check_pool_fits", "KVCacheOutOfMemory", "NoFreeBlocksError", "RequestTooLongError",
    "AttentionBackend", "TorchBackend", "BACKENDS", "resolve_backend",
]
