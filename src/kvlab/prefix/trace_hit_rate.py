"""Prefix cache hit rate on a real trace, against the pool's capacity, without a single tensor.

A Mooncake trace gives every prompt as a list of block keys that already identify the whole prefix
(`kvlab.traces.mooncake`). That is all a prefix cache looks at, so the engine's own
`PrefixCachingKVCacheManager` can replay a trace of 12,000 requests in seconds, the key standing in
for both the block hash and the block's token ids in the exact check. Two figures per trace:

* `unbounded_hit_rate`: a cache that never evicts, the ceiling no real cache beats. A prompt hits
  its longest run of leading blocks seen before (capped at n - 1 tokens, as the engine caps it).
* `lru_hit_rate`: the pool holds `capacity_blocks` blocks and evicts least recently used first,
  tail blocks before prefix blocks: `PrefixCachingKVCacheManager` itself, one request at a time.

What this replay assumes, and stage 7 does not: requests are served one at a time in arrival order,
and a request holds its blocks only during its own prefill, so the whole pool is available as
cache. A busy server holds the blocks of its running requests, so its cache is smaller and its hit
rate lower; this is the best a pool of that size can do on this traffic. Output tokens are never
hit (the trace has no hashes for them), so they are left out. `pool_blocks_for` turns a model
and a card into a capacity (stage 4's `num_blocks_for_budget`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from ..config import load_config
from ..paged.budget import num_blocks_for_budget
from ..errors import SizingError
from ..gpus import CARDS, find_card
from ..sizing import kv_bytes_per_token, weights_bytes
from ..traces.mooncake import TRACE_BLOCK_SIZE, block_keys
from ..workload import Request
from .block_tokens import BlockTokens
from .manager import PrefixCachingKVCacheManager

__all__ = ["TraceHitRate", "unbounded_hit_rate", "lru_hit_rate", "hit_rate_curve",
           "pool_blocks_for"]


@dataclasses.dataclass
class TraceHitRate:
    """The outcome of one replay; capacity_blocks None is the unbounded cache. num_too_big counts
    requests needing more blocks than the whole pool (skipped, not counted in the token figures);
    num_hit_tokens are the prefill tokens saved; num_evictions counts cached blocks reused for other
    tokens; hit_tokens holds each request's hit tokens in order (0 if too big)."""

    capacity_blocks: int | None
    block_size: int
    num_requests: int = 0
    num_too_big: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_evictions: int = 0
    hit_tokens: list[int] = dataclasses.field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        """Tokens hit / prompt tokens queried."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def capacity_tokens(self) -> int | None:
        return None if self.capacity_blocks is None else self.capacity_blocks * self.block_size


def unbounded_hit_rate(requests: Iterable[Request],
                       block_size: int = TRACE_BLOCK_SIZE) -> TraceHitRate:
    """The ceiling: a cache that keeps every full block forever (block_size must divide 512)."""
    result = TraceHitRate(None, block_size)
    seen: set[int] = set()
    for request in requests:
        keys = block_keys(request, block_size)
        hits = 0
        for key in keys[:(request.prompt_len - 1) // block_size]:  # the n - 1 cap
            if key not in seen:
                break
            hits += 1
        seen.update(keys[:request.prompt_len // block_size])  # full blocks only
        result.num_requests += 1
        result.num_query_tokens += request.prompt_len
        result.num_hit_tokens += hits * block_size
        result.hit_tokens.append(hits * block_size)
    return result


class _TraceKeys(BlockTokens):
    """A trace prompt as the manager reads it: block i's content, and its hash, is its key."""

    __slots__ = ("keys", "length")

    def __init__(self, keys: list[int], length: int):
        self.keys, self.length = keys, length

    def __len__(self) -> int:
        return self.length

    def block(self, index: int, block_size: int) -> tuple[int]:
        return (self.keys[index],)

    def block_hash(self, parent_hash, content, extra_keys, hash_fn) -> int:
        return content[0]  # the key already names the whole prefix

    def extend(self, token_ids) -> None:
        raise ValueError("a trace prompt has no outputs here")

    def copy(self) -> "_TraceKeys":
        return self


class _TraceRequest:
    """What the manager reads of a request: its id, size, salt, hash chain and tokens."""

    __slots__ = ("request_id", "num_tokens", "cache_salt", "kv_block_hashes", "tokens")

    def __init__(self, request_id: int, tokens: _TraceKeys, block_size: int):
        self.request_id, self.num_tokens, self.cache_salt = request_id, len(tokens), None
        self.kv_block_hashes = tokens.keys[:len(tokens) // block_size]  # computed already
        self.tokens = tokens


class _TraceManager(PrefixCachingKVCacheManager):
    def read_tokens(self, request: _TraceRequest) -> BlockTokens:
        return request.tokens


def lru_hit_rate(requests: Iterable[Request], capacity_blocks: int,
                 block_size: int = TRACE_BLOCK_SIZE) -> TraceHitRate:
    """Hit rate of the engine's manager on a pool of `capacity_blocks` blocks, one request at a
    time. ValueError: capacity_blocks < 1, or a block_size not dividing 512."""
    manager = _TraceManager(capacity_blocks, block_size)
    result = TraceHitRate(capacity_blocks, block_size)
    for index, trace_request in enumerate(requests):
        keys = block_keys(trace_request, block_size)
        if len(keys) > capacity_blocks:
            result.num_too_big += 1
            result.hit_tokens.append(0)
            continue
        request = _TraceRequest(index, _TraceKeys(keys, trace_request.prompt_len), block_size)
        blocks, hit = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)  # fits: all free
        manager.free(request)
        result.num_requests += 1
        result.num_query_tokens += request.num_tokens
        result.num_hit_tokens += hit
        result.hit_tokens.append(hit)
    result.num_evictions = manager.pool.num_evictions
    return result


def hit_rate_curve(requests: Sequence[Request], capacities_blocks: Iterable[int],
                   block_size: int = TRACE_BLOCK_SIZE) -> list[TraceHitRate]:
    """`lru_hit_rate` at each capacity (the same requests each time)."""
    return [lru_hit_rate(requests, capacity, block_size) for capacity in capacities_blocks]


def pool_blocks_for(model: str, gpu: str, num_gpus: int = 1, block_size: int = TRACE_BLOCK_SIZE,
                    dtype: str = "bf16", gpu_memory_utilization: float = 0.9) -> int:
    """Blocks of `block_size` tokens a server of `model` on `num_gpus` tensor-parallel cards pools.

    Each card holds 1/num_gpus of the weights and of every token's K/V, so the pool is what one card
    allows: (utilization x card bytes - weights per card) // (block_size x KV bytes per token per
    card). Activations and the CUDA context are ignored (vLLM profiles them), so this is slightly
    generous. Llama-3.1-8B, bf16, one H100-80GB, 0.9: 912 blocks of 512. SizingError or ConfigError
    for an unknown model, card or tensor parallelism; KVCacheOutOfMemory when the weights leave no
    room for one block.
    """
    card = find_card(gpu)
    if card is None:
        raise SizingError(f"unknown GPU {gpu!r}; known: {', '.join(CARDS)}")
    config = load_config(model)
    budget = int(card.memory_bytes * gpu_memory_utilization)
    block_bytes = block_size * kv_bytes_per_token(config, dtype, num_gpus)
    return num_blocks_for_budget(budget, weights_bytes(config, dtype, num_gpus), block_bytes)
