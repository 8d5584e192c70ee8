"""How many blocks a server can afford, and the start-up check that one request fits.

vLLM does not size its pool from the traffic. At start-up it loads the weights, runs one profiling
forward pass at the largest batch to measure peak activation memory, and gives every byte that is
left of `gpu_memory_utilization x total GPU memory` to the block pool:

    num_blocks = (budget - weights - activations) // bytes of one block

(vLLM v1 worker, `determine_available_memory`; the paper, Kwon et al., SOSP 2023, section 4.2,
pre-allocates the pool the same way). It then refuses to start when the pool cannot hold a single
request of max_model_len tokens, because such a request could never be served.

Unlike stage 2, the pool size does not depend on max_num_seqs: blocks go to whichever sequences
need them, so a bigger max_num_seqs costs nothing up front.
"""

from __future__ import annotations

from ..config import LlamaConfig
from ..dtypes import DTypeLike
from ..sizing import format_bytes, kv_bytes_per_token
from .block_table import cdiv
from ..errors import KVCacheOutOfMemory

__all__ = ["kv_block_bytes", "num_blocks_for_budget", "check_pool_fits"]


def kv_block_bytes(config: LlamaConfig, block_size: int, dtype: DTypeLike = "fp32") -> int:
    """Bytes one block id stands for: its K and V slots in every layer (dtype: `kvlab.dtypes`).

    = 2 x num_hidden_layers x block_size x num_key_value_heads x head_dim x dtype bytes
    = block_size x KV bytes per token. Llama-3.1-8B, bf16, block_size 16: 16 x 128 KiB = 2 MiB.
    """
    return block_size * kv_bytes_per_token(config, dtype)


def num_blocks_for_budget(budget_bytes: int, weights_bytes: int, block_bytes: int,
                          activation_bytes: int = 0) -> int:
    """(budget_bytes - weights_bytes - activation_bytes) // block_bytes, at least 1: budget_bytes
    is gpu_memory_utilization x total bytes on a GPU, block_bytes `kv_block_bytes`, activation_bytes
    the peak of a profiling run. KVCacheOutOfMemory when less than one block is left (the message
    gives each number in bytes)."""
    left = budget_bytes - weights_bytes - activation_bytes
    if left < block_bytes:
        raise KVCacheOutOfMemory(
            f"budget {budget_bytes:,} B ({format_bytes(budget_bytes)}) - weights {weights_bytes:,} B "
            f"({format_bytes(weights_bytes)}) - activations {activation_bytes:,} B leaves "
            f"{left:,} B for the KV cache, less than one block of {block_bytes:,} B")
    return left // block_bytes


def check_pool_fits(num_blocks: int, block_size: int, max_model_len: int,
                    block_bytes: int | None = None) -> None:
    """vLLM's start-up check: KVCacheOutOfMemory unless the pool holds one max_model_len request
    ("a max_model_len=2048 request needs 128 blocks of 16 tokens, the pool has 100 blocks (1600
    tokens)", plus the bytes when block_bytes is given)."""
    needed = cdiv(max_model_len, block_size)
    if needed > num_blocks:
        message = (f"a max_model_len={max_model_len} request needs {needed} blocks of {block_size} "
                   f"tokens, the pool has {num_blocks} blocks ({num_blocks * block_size} tokens)")
        if block_bytes is not None:
            message += (f": {format_bytes(needed * block_bytes)} needed, "
                        f"{format_bytes(num_blocks * block_bytes)} in the pool")
        raise KVCacheOutOfMemory(message + "; lower max_model_len or give the cache more memory")
