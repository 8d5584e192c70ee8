"""The prefix cache: block hash -> cached block, checked exactly, with LRU eviction for free.

Two pieces, both without tensors:

* `PrefixCache`, the map from block hash to the blocks that hold that prefix. A block is *cached*
  while it has an entry here: its K/V is final, and a later request with that prefix may use it.
* `CachingBlockPool`, the stage-4 `BlockPool` taught to keep cached blocks. A freed block goes to
  the free block queue as before but keeps its entry: free (any allocation may take it) and cached
  (a hit may take it back) at once. Allocation takes the head of the queue and drops a cached
  block's entry at that moment (an *eviction*), so a recycled block is never found under its old
  hash.

So the free block queue is the LRU list, as in vLLM v1's `BlockPool` + `FreeKVCacheBlockQueue`:
blocks join its tail when their last holder lets go, a hit takes one out of the middle (O(1),
`FreeBlockQueue.remove`), and the head is the least recently used. Sequences release their blocks
tail first, so a cached block's parent is never evicted before the block itself.

One step beyond vLLM, which trusts the hash: a hit is *confirmed*. A candidate counts only if its
token ids and extra keys equal the request's and its parent entry is the very entry the lookup
matched one block earlier, so by induction every token of the prefix is checked and a colliding
hash can only cost a miss, never hand out another prompt's K/V. The parent is compared by entry
identity, not block id: a recycled parent block gets a new entry, so children cached under its old
contents no longer match. The price is a rare false miss (a block computed twice: a lookup that
matched one copy does not continue into children cached under the other). SGLang's RadixAttention
gets the same exactness from a radix tree keyed by the token ids themselves: no hash to collide.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, Sequence

from ..paged.block_pool import Block, BlockPool
from ..paged.free_queue import FreeBlockQueue

__all__ = ["CachedBlock", "PrefixCache", "CachingBlockPool"]


@dataclasses.dataclass(eq=False, slots=True)  # slots: a trace replay makes millions of them
class CachedBlock:
    """The cache entry of one full block, compared by identity (eq=False), never by value:
    block_hash is bytes for SHA-256 (any hashable in a trace simulation); token_ids (block_size of
    them) and extra_keys are kept for the exact check; parent is None for block 0."""

    block_id: int
    block_hash: Hashable
    token_ids: tuple[int, ...]
    extra_keys: tuple[Hashable, ...]
    parent: "CachedBlock | None"

    def __repr__(self) -> str:  # the parent chain is not printed: it can be long
        return f"CachedBlock(block_id={self.block_id}, tokens={list(self.token_ids)})"


class PrefixCache:
    """Block hash -> its entry, and block_id -> entry. One hash may map to several blocks (the
    same block computed twice, or, with a weak hash, different prefixes sharing a hash): then its
    value is {block_id: entry}, in insertion order. A lone entry is stored as itself, as in vLLM
    v1's `BlockHashToBlockMap`: a dict per hash would cost one more object per cached block.
    verify=False trusts the hash alone, as vLLM does (only to show what a collision does)."""

    def __init__(self, verify: bool = True):
        self.verify = verify
        self._by_hash: dict[Hashable, CachedBlock | dict[int, CachedBlock]] = {}
        self._by_block: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        """Blocks that are cached (free or in use)."""
        return len(self._by_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    def entry(self, block_id: int) -> CachedBlock | None:
        """The entry of a block, or None if it is not cached."""
        return self._by_block.get(block_id)

    def entries(self) -> Iterable[CachedBlock]:
        return self._by_block.values()

    def knows_hash(self, block_hash: Hashable) -> bool:
        """Some cached block has this hash (it may still fail the exact check)."""
        return block_hash in self._by_hash

    def find(self, block_hash: Hashable, token_ids: tuple[int, ...],
             extra_keys: tuple[Hashable, ...], parent: CachedBlock | None) -> CachedBlock | None:
        """The cached block holding these token_ids and extra_keys after `parent` (the entry this
        lookup matched one block earlier; None for block 0), or None (a miss). Changes nothing."""
        same_hash = self._by_hash.get(block_hash)
        if same_hash is None:
            return None
        for candidate in (same_hash,) if type(same_hash) is CachedBlock else same_hash.values():
            if not self.verify:
                return candidate  # vLLM's rule: the hash alone decides
            if (candidate.parent is parent and candidate.token_ids == token_ids
                    and candidate.extra_keys == extra_keys):
                return candidate
        return None

    def insert_chain(self, block_ids: Sequence[int], block_hashes: Sequence[Hashable],
                     contents: Sequence[tuple[int, ...]], extra_keys: tuple[Hashable, ...],
                     parent: CachedBlock | None) -> list[CachedBlock]:
        """Cache consecutive full blocks of one sequence whose K/V holds exactly this prefix, each
        the parent of the next (`parent`: the entry before the first, None for block 0); their
        entries. Contents and extra_keys are tuples, as `find` compares them; ValueError if the
        three sequences differ in length. A block already cached keeps its entry: a full block is
        never written again."""
        by_block, by_hash, chain = self._by_block, self._by_hash, []
        for block_id, block_hash, content in zip(block_ids, block_hashes, contents, strict=True):
            entry = by_block.get(block_id)
            if entry is None:
                entry = CachedBlock(block_id, block_hash, content, extra_keys, parent)
                by_block[block_id] = entry
                same_hash = by_hash.setdefault(block_hash, entry)
                if same_hash is not entry:  # the hash has an entry already, or a dict of them
                    if type(same_hash) is CachedBlock:
                        by_hash[block_hash] = {same_hash.block_id: same_hash, block_id: entry}
                    else:
                        same_hash[block_id] = entry
            chain.append(entry)
            parent = entry
        return chain

    def drop_all(self, block_ids: Iterable[int]) -> int:
        """Forget these blocks' entries (they are about to hold other tokens); how many had one."""
        by_block, by_hash, dropped = self._by_block, self._by_hash, 0
        for block_id in block_ids:
            entry = by_block.pop(block_id, None)
            if entry is None:
                continue
            same_hash = by_hash[entry.block_hash]
            if same_hash is entry:
                del by_hash[entry.block_hash]
            else:
                del same_hash[block_id]
                if not same_hash:
                    del by_hash[entry.block_hash]
            dropped += 1
        return dropped


class CachingBlockPool(BlockPool):
    """A `BlockPool` whose free block queue doubles as the LRU list of `cache`'s blocks;
    num_evictions counts cached blocks whose entry was dropped because allocation reused them."""

    free_queue_type = FreeBlockQueue  # a hit takes a block out of the middle in O(1)

    def __init__(self, num_blocks: int, cache: PrefixCache):
        super().__init__(num_blocks)
        self.cache = cache
        self.num_evictions = 0

    def _take_free(self, count: int) -> list[Block]:
        """`BlockPool._take_free` in one walk along the links, not `count` unlinks."""
        return self.free_queue.popleft_many(count)

    def _before_reuse(self, blocks: list[Block]) -> None:
        """`allocate` (least recently used first) reuses free blocks: a block still cached loses
        its entry here, before anyone can write other tokens' K/V into it."""
        self.num_evictions += self.cache.drop_all([block.block_id for block in blocks])

    def touch(self, block_ids: Iterable[int]) -> None:
        """A cache hit takes these blocks (`BlockPool.touch`); ValueError for one not cached."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if block_id not in self.cache:
                raise ValueError(f"block {block_id} is not cached; only a cached block can be hit")
        super().touch(block_ids)
