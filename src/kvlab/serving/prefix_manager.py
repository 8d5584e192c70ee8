"""The paged + prefix-cached strategy: stage 6's manager behind the scheduler's `KVManager`.

`kvlab.prefix.PrefixCachingKVCacheManager` keeps stage 4's block pool and adds a cache of full
blocks keyed by a hash chained through the parent block (vLLM v1's automatic prefix caching). At
admission the scheduler's request is looked up block by block: the leading blocks found are shared
(ref count + 1) and never computed, and only the rest is prefilled. A finished request's blocks go
back to the free queue but keep their hash until reused (LRU eviction), so the next request with
the same prefix still finds them.

The manager hashes token ids. In model mode those are the request's real ids. In simulation there
are no ids, so the trace's prefix information stands in for them: token p of a prompt whose
512-token block p // 512 has trace id h gets the id h x 512 + p % 512 (equal exactly where the
trace says two prompts share that block; this is `kvlab.traces.mooncake.expand_hash_ids` at block
size 1). Prompts without block ids (the Azure trace) and every output token get an id of their own
request (-1 - request_id), so they never hit another request's blocks; that is the honest
assumption when a trace says nothing about sharing.
"""

from __future__ import annotations

from ..errors import NoFreeBlocksError
from .kv_managers import PagedManager
from .request import Request

__all__ = ["PrefixManager"]


class PrefixManager(PagedManager):
    """Paged blocks with automatic prefix caching: `PagedManager` whose admission shares cached
    blocks and whose appends name their tokens (so a block is hashed once it is full).

    Args:
        manager: the `PrefixCachingKVCacheManager` (in model mode: the one the `PagedKVCache` the
            model reads uses, so blocks found in the cache really hold those tokens' K/V).
        max_model_len: longest request accepted (the pool must hold one; checked here).

    Raises:
        ValueError: the pool cannot hold one max_model_len request.
    """

    name = "paged+prefix"
    has_prefix_cache = True

    def allocate(self, request: Request, token_budget: int) -> int | None:
        # The whole prompt (+ outputs after a preemption) is reserved at admission, the cached
        # part shared; chunks computed in later steps find their slots already there.
        tokens = token_ids(request, 0, request.num_tokens)
        try:
            allocation = self.manager.allocate_with_prefix(request.request_id, tokens)
        except NoFreeBlocksError:
            return None
        return allocation.num_cached_tokens

    def append(self, request: Request, num_new_tokens: int) -> bool:
        table = self.manager.tables[request.request_id]
        end = request.num_computed_tokens + num_new_tokens
        if end <= table.num_tokens:
            return True  # the rest of a prompt reserved at admission
        start = table.num_tokens
        if (len(table.block_ids) * self.block_size > end - 1 and end % self.block_size
                and self._pool_blocks[table.block_ids[-1]].ref_count == 1):
            # Fast path, most decode steps: the tokens fit in the last block and do not fill it,
            # so there is no block to take and none to hash (only full blocks are cached). The
            # manager still records the ids, which it hashes once the block is full.
            table.num_tokens = end
            self.manager._tokens[request.request_id] += token_ids(request, start, end)
            return True
        try:
            self.manager.append_slots(request.request_id, end - start,
                                      token_ids(request, start, end))
        except NoFreeBlocksError:
            return False
        return True


def token_ids(request: Request, start: int, end: int) -> list[int]:
    """Ids of tokens start .. end - 1 of a request: its real ids where it has them (model mode, or
    a prompt given with ids), else the stand-ins described in the module docstring."""
    own = -1 - request.request_id
    known = request.prompt_token_ids
    if known is not None:
        known = known + request.output_token_ids  # outputs are known in model mode only
        return known[start:end] + [own] * (end - max(start, len(known)))
    size, hashes = request.hash_block_size, request.block_hashes
    ids: list[int] = []
    position = start
    prompt_end = min(end, request.prompt_len)
    while position < prompt_end:
        block = position // size if hashes else len(hashes)
        if block < len(hashes):  # a block the trace names: ids shared with every prompt that has it
            block_end = min(prompt_end, (block + 1) * size)
            base = hashes[block] * size
            ids += range(base + position % size, base + position % size + block_end - position)
        else:
            block_end = prompt_end
            ids += [own] * (block_end - position)
        position = block_end
    return ids + [own] * (end - max(start, request.prompt_len))
