"""The KV cache manager with automatic prefix caching.

`PrefixCachingKVCacheManager` is the stage-4 `KVCacheManager` plus a prefix cache. What changes:

* A new sequence is admitted with its token ids, `allocate_with_prefix(seq_id, token_ids,
  cache_salt, block_hashes)`. The manager looks the prompt up block by block (`lookup`), puts the hit blocks at
  the front of the block table (shared, ref count + 1; a free one leaves the free block queue),
  allocates blocks for the rest, and returns `num_cached_tokens`: prefill starts there, at absolute
  positions num_cached_tokens, num_cached_tokens + 1, ... The tokens of the hit are never computed.
* The hit is capped so that at least one prompt token is computed: its logits give the first
  output token, and a prompt that was cached whole would otherwise have nothing to run. vLLM's v1
  KV cache manager caps at n - 1 tokens the same way; with whole-block hits that means at most
  (n - 1) // block_size blocks.
* Every time a sequence's block becomes full (at admission, or later in decode through
  `append_slots(..., token_ids=...)`) it is hashed and cached, so a later request can hit it.
  Blocks are cached when their slots are reserved, as vLLM v1 does, so a request admitted later
  in the same step may hit a block whose K/V that step's forward pass has not written yet. The
  rule that makes this correct: a block is readable from the pass that writes it on. The serving
  runner keeps it by running a step as one forward pass that, in each layer, writes the K/V of
  every token of the step before any token attends (why, and what two passes got wrong:
  `kvlab.serving.model_runner`; tests/test_one_pass.py).
* `free` and `preempt` work as before: blocks go back to the free block queue tail first, but keep
  their cache entries until allocation reuses them (LRU eviction, see `prefix_cache`). A preempted
  sequence may therefore hit its own blocks when it is admitted again.
* Each full block of a sequence is hashed once. A caller may keep the sequence's hash chain in a
  list it owns (`block_hashes`, vLLM v1's `request.block_hashes`) and pass the same list at every
  admission attempt: hashes already in it are reused, missing ones are computed and appended. A
  scheduler that retries the head of its queue every step then hashes nothing on a retry, and the
  hits a refused admission found are only checked to be still cached (the lookup goes on from
  there with the exact check of `PrefixCache.find`).
* The manager reads a sequence block by block through `BlockTokens` (`.block_tokens`): real ids by
  default (a block's content is its ids, hashed with `hash_fn`); a trace simulation may pass a
  `BlockTokens` that describes its blocks without building one id per token.

Forks (n > 1) share all blocks as in stage 4; the child inherits the parent's chain of entries, and
copy-on-write only ever copies a partly filled block, which is never cached.

Sources: vLLM v1 KV cache manager (automatic prefix caching: full-block hashes chained through the
parent, an LRU free block queue, the n - 1 cap); SGLang RadixAttention (Zheng et al., "SGLang:
Efficient Execution of Structured Language Model Programs", 2024) for the same idea as a radix tree.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

from ..paged.block_table import BlockTable, cdiv
from ..checks import check_int
from ..errors import NoFreeBlocksError, RequestTooLongError
from ..paged.kv_cache_manager import KVCacheManager, SlotReservation
from .block_hash import BlockHash, HashFunction, extra_keys_for, sha256, short
from .block_tokens import BlockTokens, as_block_tokens
from .prefix_cache import CachedBlock, CachingBlockPool, PrefixCache

__all__ = ["PrefixCacheStats", "PrefixAllocation", "PrefixCachingKVCacheManager"]


@dataclasses.dataclass
class PrefixCacheStats:
    """What the prefix cache saved, in tokens and blocks (x bytes_per_token / block_bytes = bytes).

    Attributes:
        num_lookups: prompts looked up (one per admission, re-admissions after preemption too).
        num_query_tokens: prompt tokens of those lookups.
        num_hit_tokens: tokens found in the cache = prefill tokens skipped.
        num_hit_blocks: blocks found in the cache = blocks neither allocated nor computed.
        num_evictions: cached blocks reused for other tokens.
        num_collisions: lookups where the hash matched an entry but the exact check refused it.
    """

    num_lookups: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_hit_blocks: int = 0
    num_evictions: int = 0
    num_collisions: int = 0

    @property
    def hit_rate(self) -> float:
        """Prefix cache hit rate: tokens hit / prompt tokens queried (0 before any lookup)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def prefill_tokens_skipped(self) -> int:
        return self.num_hit_tokens


@dataclasses.dataclass
class PrefixAllocation:
    """What `allocate_with_prefix` did.

    Attributes:
        num_cached_tokens: prompt tokens whose K/V came from the cache (a multiple of block_size);
            prefill runs positions num_cached_tokens .. len(token_ids) - 1.
        slots: the slots of those positions, in order.
        hit_block_ids: the cached blocks now at the front of the block table.
    """

    num_cached_tokens: int
    slots: list[int]
    hit_block_ids: list[int]


class PrefixCachingKVCacheManager(KVCacheManager):
    """Block tables over a pool whose full blocks are cached by prefix.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        hash_fn: bytes -> bytes block hash function (default SHA-256).
        verify: confirm every hit against the stored tokens (default); False trusts the hash
            alone, as vLLM does (only to show what a collision does).

    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFunction = sha256,
                 verify: bool = True):
        super().__init__(num_blocks, block_size)
        self.prefix_cache = PrefixCache(verify=verify)
        self.pool = CachingBlockPool(num_blocks, self.prefix_cache)
        self.hash_fn = hash_fn
        # Per sequence admitted with token ids: its tokens, extra keys, full-block hash chain
        # (block i's hash at index i; may run ahead of the cached chain) and cached-block chain.
        self._tokens: dict[Hashable, BlockTokens] = {}
        self._hashes: dict[Hashable, list[BlockHash]] = {}
        self._extra_keys: dict[Hashable, tuple] = {}
        self._chains: dict[Hashable, list[CachedBlock]] = {}
        # A refused admission's hits, kept for its retry: seq_id -> (its hash chain, the entries).
        self._refused_hits: dict[Hashable, tuple[list[BlockHash], list[CachedBlock]]] = {}
        self._stats = PrefixCacheStats()

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int] | BlockTokens,
               cache_salt: str | None = None) -> list[CachedBlock]:
        """The longest run of cached full blocks that starts the prompt, capped at n - 1 tokens.

        Changes nothing (no ref counts, no LRU order, no statistics). `token_ids` may be ids or a
        `BlockTokens` (as in `allocate_with_prefix`).

        Returns:
            the entries of blocks 0, 1, ..., k - 1, k <= (len(token_ids) - 1) // block_size.
        """
        return self._lookup(as_block_tokens(token_ids), extra_keys_for(cache_salt),
                            count_collisions=False, block_hashes=[])

    def _block_hash(self, block_hashes: list[BlockHash], index: int, tokens: BlockTokens,
                    content: tuple, extra_keys: tuple) -> BlockHash:
        """Hash of full block `index` (its `content`): from `block_hashes` when it is there, else
        computed from block index - 1's hash and appended (blocks are hashed in order, so the list
        always holds blocks 0 .. index - 1 here)."""
        if index < len(block_hashes):
            return block_hashes[index]
        block_hash = tokens.block_hash(block_hashes[index - 1] if index else None, content,
                                       extra_keys, self.hash_fn)
        block_hashes.append(block_hash)
        return block_hash

    def _lookup(self, tokens: BlockTokens, extra_keys: tuple, count_collisions: bool,
                block_hashes: list[BlockHash],
                known_hits: Sequence[CachedBlock] = ()) -> list[CachedBlock]:
        size = self.block_size
        max_blocks = (len(tokens) - 1) // size  # at least one prompt token is computed
        # Hits an earlier lookup of the same blocks found are found again while each is still
        # cached: a bucket keeps insertion order, so an entry stays the first one there with its
        # parent and content until it is dropped (a refused admission's retry checks only this).
        hits: list[CachedBlock] = []
        for entry in known_hits[:max_blocks]:
            if self.prefix_cache.entry(entry.block_id) is not entry:
                break
            hits.append(entry)
        parent: CachedBlock | None = hits[-1] if hits else None
        for index in range(len(hits), max_blocks):
            content = tokens.block(index, size)
            # A hit's hash is the hash looked up, so block_hashes[index - 1] is parent's hash.
            block_hash = self._block_hash(block_hashes, index, tokens, content, extra_keys)
            entry = self.prefix_cache.find(block_hash, content, extra_keys, parent)
            if entry is None:
                if count_collisions and self.prefix_cache.knows_hash(block_hash):
                    self._stats.num_collisions += 1
                break
            hits.append(entry)
            parent = entry
        return hits

    def blocks_to_admit(self, token_ids: Sequence[int] | BlockTokens,
                        cache_salt: str | None = None) -> int:
        """Free blocks `allocate_with_prefix` would take now: new blocks + hit blocks now free."""
        hits = [entry.block_id for entry in self.lookup(token_ids, cache_salt)]
        new_blocks = cdiv(len(token_ids), self.block_size) - len(hits)
        return new_blocks + self.pool.num_free_to_touch(hits)

    def can_admit(self, token_ids: Sequence[int] | BlockTokens,
                  cache_salt: str | None = None) -> bool:
        return self.blocks_to_admit(token_ids, cache_salt) <= self.pool.num_free_blocks

    # ---- admission ---------------------------------------------------------------------------

    def allocate_with_prefix(self, seq_id: Hashable, token_ids: Sequence[int] | BlockTokens,
                             cache_salt: str | None = None,
                             block_hashes: list[BlockHash] | None = None,
                             token_budget: int | None = None) -> PrefixAllocation:
        """Admit a sequence: share its cached prefix blocks, allocate the rest, cache full blocks.

        Args:
            seq_id: the new sequence's key.
            token_ids: its tokens (ints; the prompt, plus outputs when a preempted one comes back),
                or a `BlockTokens` that describes them block by block (the manager keeps a copy).
            cache_salt: optional salt; only blocks hashed with the same salt are hit.
            block_hashes: the sequence's full-block hash chain, kept by the caller between
                attempts (None: a fresh one). Must have been filled by earlier calls for this
                sequence with the same salt and a prefix of the same token_ids; the manager reuses
                the hashes in it, appends the ones it computes (also those of blocks that fill up
                later in `append_slots`) and keeps a reference until `free`. A retried admission
                with the same list computes no hash.
            token_budget: reserve slots only for what the first step computes: the cached prefix
                plus at most this many tokens (vLLM v1 allocates, step by step, the slots of the
                tokens each step computes; a long prompt prefilled in chunks takes its blocks chunk
                by chunk through `append_slots`). None: all of token_ids at once. The hit is
                looked up over all of token_ids either way; the manager keeps them all, so later
                `append_slots` calls over them need no ids.

        Raises:
            ValueError: seq_id already has a block table, or token_ids is empty.
            TypeError: cache_salt is not a str.
            RequestTooLongError: more tokens than the whole pool holds.
            NoFreeBlocksError: not enough free blocks now (nothing changed, not even statistics).
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        if len(token_ids) < 1:
            raise ValueError("a sequence starts with at least one token, got 0")
        size, pool = self.block_size, self.pool
        if cdiv(len(token_ids), size) > pool.num_blocks:
            raise RequestTooLongError(
                f"sequence {seq_id!r} would hold {len(token_ids)} tokens = "
                f"{cdiv(len(token_ids), size)} blocks of {size}, more than the whole pool of "
                f"{pool.num_blocks} blocks ({pool.num_blocks * size} tokens)")
        extra_keys = extra_keys_for(cache_salt)
        if block_hashes is None:
            block_hashes = []
        tokens = as_block_tokens(token_ids)
        hits = self._lookup(tokens, extra_keys, count_collisions=True, block_hashes=block_hashes,
                            known_hits=self._hits_of_refusal(seq_id, block_hashes))
        hit_ids = [entry.block_id for entry in hits]
        table = BlockTable(size, list(hit_ids), num_tokens=len(hits) * size)
        num_new = len(token_ids) - table.num_tokens
        if token_budget is not None:
            num_new = min(num_new, check_int("token_budget", token_budget, 1))
        new_blocks = table.num_blocks_after(num_new)
        needed = new_blocks + pool.num_free_to_touch(hit_ids)  # a free hit leaves the queue too
        if needed > pool.num_free_blocks:
            self._refused_hits[seq_id] = (block_hashes, hits)  # for its retry; changes no state
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {needed} free blocks ({new_blocks} new + "
                f"{needed - new_blocks} cached ones that are free), {pool.num_free_blocks} of "
                f"{pool.num_blocks} are free")
        # Touch the hits first: taken out of the free queue, allocation below cannot evict them.
        pool.touch(hit_ids)
        table.block_ids += pool.allocate(new_blocks)
        self.tables[seq_id] = table
        num_cached = table.num_tokens
        slots = self._reserve(table, num_new)
        self._tokens[seq_id] = tokens
        self._extra_keys[seq_id] = extra_keys
        self._hashes[seq_id] = block_hashes
        self._chains[seq_id] = list(hits)
        self._cache_full_blocks(seq_id)

        stats = self._stats
        stats.num_lookups += 1
        stats.num_query_tokens += len(token_ids)
        stats.num_hit_tokens += num_cached
        stats.num_hit_blocks += len(hits)
        return PrefixAllocation(num_cached, slots, hit_ids)

    def _hits_of_refusal(self, seq_id: Hashable, block_hashes: list[BlockHash]
                         ) -> list[CachedBlock]:
        """The hits of this sequence's last admission if it was refused and the caller passes the
        same hash chain (so the same tokens: see `allocate_with_prefix`), else none."""
        refused = self._refused_hits.pop(seq_id, None)
        return refused[1] if refused is not None and refused[0] is block_hashes else []

    def _cache_full_blocks(self, seq_id: Hashable) -> None:
        """Give every full block of the sequence not yet in its chain a hash and a cache entry."""
        table, tokens = self.tables[seq_id], self._tokens[seq_id]
        chain, extra_keys = self._chains[seq_id], self._extra_keys[seq_id]
        size, hashes, cache = self.block_size, self._hashes[seq_id], self.prefix_cache
        for index in range(len(chain), table.num_tokens // size):
            content = tokens.block(index, size)
            block_hash = self._block_hash(hashes, index, tokens, content, extra_keys)
            block_id = table.block_ids[index]
            # A full block is never written again, so an existing entry of it is still right.
            entry = cache.entry(block_id) or cache.insert(block_id, block_hash, content,
                                                          extra_keys, chain[-1] if chain else None)
            chain.append(entry)

    # ---- the stage-4 operations, keeping the token ids --------------------------------------

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1,
                     token_ids: Sequence[int] | None = None) -> SlotReservation:
        """Reserve slots for new tokens; blocks they fill are cached.

        Args:
            token_ids: the new tokens (required for a sequence admitted by allocate_with_prefix,
                len == num_new_tokens; ignored for one admitted by plain `allocate`).

        Raises:
            ValueError: token_ids missing or of the wrong length (checked first; nothing changes).
            KeyError, RequestTooLongError, NoFreeBlocksError: see `KVCacheManager.append_slots`.
        """
        tracked = seq_id in self._tokens
        unknown = self._num_unknown(seq_id, num_new_tokens) if tracked else 0
        if unknown > 0 and (token_ids is None or len(token_ids) != num_new_tokens):
            got = "none" if token_ids is None else len(token_ids)
            raise ValueError(f"sequence {seq_id!r} is prefix-cached: append_slots needs the "
                             f"{num_new_tokens} new token ids, got {got}")
        reservation = super().append_slots(seq_id, num_new_tokens)
        if tracked:
            if unknown > 0:
                self._tokens[seq_id].extend(token_ids[num_new_tokens - unknown:])
            self._cache_full_blocks(seq_id)
        return reservation

    def num_known_tokens(self, seq_id: Hashable) -> int:
        """Tokens of a sequence the manager holds ids of (more than it reserved while a prompt
        given whole is reserved chunk by chunk): `append_slots` up to here needs no ids.
        Raises KeyError for a sequence not admitted by `allocate_with_prefix`."""
        return len(self._tokens[seq_id])

    def _num_unknown(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Of `num_new_tokens` more slots, how many hold tokens the manager has not been given."""
        return self.tables[seq_id].num_tokens + num_new_tokens - self.num_known_tokens(seq_id)

    def append_in_last_block(self, seq_id: Hashable, token_ids: Sequence[int]) -> bool:
        """A decode step's fast path: record new tokens that fit in the sequence's last block.

        When the tokens neither need a new block nor fill the last one, and that block is not
        shared (so no copy-on-write), there is no block to take and none to hash (only full blocks
        are cached): the table's token count and the sequence's token ids just grow. The caller
        needs no slots back (it computes them from the block table).

        Returns:
            True: recorded. False: this is not that case and nothing changed; use `append_slots`.

        Raises:
            KeyError: unknown seq_id.
        """
        table = self._table(seq_id)
        end = table.num_tokens + len(token_ids)
        if not (table.block_ids and end % self.block_size
                and end <= len(table.block_ids) * self.block_size
                and self.pool.blocks[table.block_ids[-1]].ref_count == 1):
            return False
        if seq_id in self._tokens:
            unknown = self._num_unknown(seq_id, len(token_ids))
            if unknown > 0:
                self._tokens[seq_id].extend(token_ids[len(token_ids) - unknown:])
        table.num_tokens = end
        return True

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """As `KVCacheManager.fork`; the child inherits the parent's tokens and cached chain."""
        super().fork(parent_id, child_id)
        if parent_id in self._tokens:
            self._tokens[child_id] = self._tokens[parent_id].copy()
            self._extra_keys[child_id] = self._extra_keys[parent_id]
            self._hashes[child_id] = list(self._hashes[parent_id])
            self._chains[child_id] = list(self._chains[parent_id])

    def free(self, seq_id: Hashable) -> None:
        """As `KVCacheManager.free` (tail first); the blocks stay cached until reused."""
        super().free(seq_id)
        for per_sequence in (self._tokens, self._extra_keys, self._hashes, self._chains):
            per_sequence.pop(seq_id, None)

    # ---- inspection --------------------------------------------------------------------------

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """A snapshot of the hit, saving and eviction counts since start-up."""
        self._stats.num_evictions = self.pool.num_evictions
        return dataclasses.replace(self._stats)

    def block_counts(self) -> dict[str, int]:
        """{'free', 'cached', 'in_use'}: always adds up to the pool (see `CachingBlockPool`)."""
        return self.pool.block_counts()

    def format_block_tables(self) -> str:
        """Stage 4's picture plus the cache: each free cached block with its hash, LRU first."""
        lines = [super().format_block_tables()]
        cached = [block for block in self.pool.free_queue if block.block_id in self.prefix_cache]
        lines.append("cached and free (evicted first -> last): " + (" ".join(
            f"{b.block_id}:{short(self.prefix_cache.entry(b.block_id).block_hash)}"
            for b in cached) or "none"))
        return "\n".join(lines)
