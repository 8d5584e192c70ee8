"""The KV-cache strategies stage 7 compares, each built in one place, by name.

`STRATEGIES` names them as `kvlab serve --strategy` does: "contiguous" (a max_model_len slab per
request, reserved at admission: stage 2), "paged" (blocks taken as tokens arrive: stage 4),
"prefix" (blocks shared by prefix: stage 6). `simulated_manager` builds the KV manager the
scheduler drives, with no tensors; `model_strategy` adds cache tensors and a `ModelRunner`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..paged.kv_cache_manager import KVCacheManager
from ..prefix.block_hash import HashFunction, sha256
from ..prefix.manager import PrefixCachingKVCacheManager
from ..sizing import kv_bytes_per_token
from .cost_model import CostModel
from .reservation import ContiguousManager, KVManager

if TYPE_CHECKING:
    from .model_runner import ModelRunner

__all__ = ["STRATEGIES", "simulated_manager", "paged_manager", "model_strategy"]

STRATEGIES = ("contiguous", "paged", "prefix")


def simulated_manager(strategy: str, kv_budget_bytes: int, bytes_per_token: int,
                      max_model_len: int, block_size: int = 16,
                      hash_fn: HashFunction = sha256) -> KVCacheManager | KVManager:
    """The strategy's KV manager for `kv_budget_bytes` at `bytes_per_token`. ValueError: an
    unknown strategy, or a budget that holds no block; KVCacheOutOfMemory: no room for one
    max_model_len request."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "contiguous":
        return ContiguousManager(kv_budget_bytes // (max_model_len * bytes_per_token),
                                 max_model_len)
    num_blocks = kv_budget_bytes // (block_size * bytes_per_token)
    if num_blocks < 1:
        raise ValueError(f"the KV budget of {kv_budget_bytes:,} B holds no block of "
                         f"{block_size} tokens x {bytes_per_token:,} B")
    return paged_manager(num_blocks, block_size, max_model_len, strategy == "prefix", hash_fn)


def paged_manager(num_blocks: int, block_size: int, max_model_len: int,
                  enable_prefix_caching: bool = False,
                  hash_fn: HashFunction = sha256) -> KVCacheManager:
    """The paged strategy's manager for a pool counted in blocks (stage 4's, or stage 6's)."""
    if enable_prefix_caching:
        return PrefixCachingKVCacheManager(num_blocks, block_size, max_model_len, hash_fn)
    return KVCacheManager(num_blocks, block_size, max_model_len)


def model_strategy(strategy: str, model, kv_budget_bytes: int, max_model_len: int,
                   block_size: int = 16, cost_model: CostModel | None = None
                   ) -> tuple[KVCacheManager | KVManager, ModelRunner]:
    """A strategy's KV manager (`simulated_manager`, same errors) and a `ModelRunner` over real
    cache tensors of `kv_budget_bytes` (a paged cache is given the manager the scheduler drives)."""
    # The tensors' modules, imported here: simulation, which needs none, starts without torch.
    from ..contiguous import ContiguousKVCache
    from ..paged.paged_cache import PagedKVCache
    from .model_runner import ModelRunner

    config = model.config
    bytes_per_token = kv_bytes_per_token(config, model.dtype)
    manager = simulated_manager(strategy, kv_budget_bytes, bytes_per_token, max_model_len,
                                block_size)
    if strategy == "contiguous":
        cache = ContiguousKVCache(config, manager.num_slabs, max_model_len, dtype=model.dtype,
                                  device=model.device)
        # the same manager, now handing out the slabs of these tensors
        manager = ContiguousManager(manager.num_slabs, max_model_len, cache)
        executor = ModelRunner(model, cache, cost_model, slabs=manager)
    else:
        cache = PagedKVCache(config, manager.pool.num_blocks, block_size, dtype=model.dtype,
                             device=model.device, manager=manager)
        executor = ModelRunner(model, cache, cost_model)
    executor.bytes_per_token = bytes_per_token
    return manager, executor
