"""The paged + prefix-cached strategy: stage 6's manager behind the scheduler's `KVManager`.

`kvlab.prefix.PrefixCachingKVCacheManager` keeps stage 4's block pool and adds a cache of full
blocks keyed by a hash chained through the parent block (vLLM v1's automatic prefix caching). At
admission the scheduler's request is looked up block by block: the leading blocks found are shared
(ref count + 1) and never computed, and only the rest is prefilled. A finished request's blocks go
back to the free queue but keep their hash until reused (LRU eviction), so the next request with
the same prefix still finds them.

Each request's full-block hashes are kept here from its first admission attempt until it
finishes (vLLM v1 keeps them on the request as `request.block_hashes`): an overloaded queue retries
its head every step, and a 12k-token prompt would otherwise be SHA-256-hashed block by block at
every retry. A preempted request keeps them too; its tokens only grow, so they still hold.

The manager hashes token ids. In model mode those are the request's real ids. In simulation there
are no ids, so the trace's prefix information stands in for them: token p of a prompt whose
512-token block p // 512 has trace id h gets the id h x 512 + p % 512 (equal exactly where the
trace says two prompts share that block; this is `kvlab.traces.mooncake.expand_hash_ids` at block
size 1). Prompts without block ids (the Azure trace) and every output token get an id of their own
request (-1 - request_id), so they never hit another request's blocks; that is the honest
assumption when a trace says nothing about sharing. The manager reads those stand-in ids through
`TraceBlocks`, which describes each block's ids in a few ints instead of building them (the same
hits, preemptions and times; see `kvlab.serving.trace_blocks`).
"""

from __future__ import annotations

from ..errors import NoFreeBlocksError
from ..prefix.block_tokens import BlockTokens
from ..prefix.manager import PrefixCachingKVCacheManager
from .kv_managers import PagedManager
from .request import Request
from .trace_blocks import TraceBlocks

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

    def __init__(self, manager: PrefixCachingKVCacheManager, max_model_len: int):
        super().__init__(manager, max_model_len)
        # request_id -> its full-block hash chain, filled by the manager (see module docstring)
        self._block_hashes: dict[int, list[bytes]] = {}

    def allocate(self, request: Request, token_budget: int) -> int | None:
        # Like `PagedManager`: slots only for what this step computes, the cached prefix shared
        # (vLLM v1). The manager is given every token the request has, so the hit is found over
        # the whole prompt and the chunks of later steps need no ids.
        try:
            allocation = self.manager.allocate_with_prefix(
                request.request_id, block_tokens(request), request.cache_salt,
                block_hashes=self._block_hashes.setdefault(request.request_id, []),
                token_budget=token_budget)
        except NoFreeBlocksError:
            return None
        return allocation.num_cached_tokens

    def append(self, request: Request, num_new_tokens: int) -> bool:
        rid = request.request_id
        start = self.manager.tables[rid].num_tokens
        end = request.num_computed_tokens + num_new_tokens
        if end <= self.manager.num_known_tokens(rid):
            new_ids = None  # a later chunk of what it brought at admission: the manager has them
        else:
            new_ids = token_ids(request, start, end)
            # Most decode steps: the tokens fit in the last block without filling it, so no block
            # is taken and none hashed; the manager records the ids and hashes the block once full.
            if self.manager.append_in_last_block(rid, new_ids):
                return True
        try:
            reservation = self.manager.append_slots(rid, end - start, new_ids)
        except NoFreeBlocksError:
            return False
        self._copies += reservation.copies
        return True

    def free(self, request: Request) -> None:
        super().free(request)
        self._block_hashes.pop(request.request_id, None)


def block_tokens(request: Request) -> list[int] | BlockTokens:
    """All tokens of a request as the prefix cache reads them at admission: its ids (model mode,
    or a prompt given with ids), else its stand-in ids described block by block (`TraceBlocks`).
    A request with forks still to make gets its stand-in ids one by one: each fork inherits the
    record and appends outputs under its own id, which `TraceBlocks` does not describe."""
    if request.prompt_token_ids is not None or request.forks:
        return token_ids(request, 0, request.num_tokens)
    return TraceBlocks(request)


def token_ids(request: Request, start: int, end: int) -> list[int]:
    """Ids of tokens start .. end - 1 of a request: its real ids where it has them (model mode, or
    a prompt given with ids), else the stand-ins described in the module docstring."""
    own = -1 - request.request_id
    known = request.prompt_token_ids
    if known is None and start >= request.prompt_len:
        return [own] * (end - start)  # simulated outputs (most calls: one decode token)
    if known is not None:
        known = known + request.output_token_ids  # outputs are known in model mode only
        return known[start:end] + [own] * (end - max(start, len(known)))
    size, hashes = request.trace_block_size, request.trace_block_ids
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
