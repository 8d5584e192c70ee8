"""The KV cache manager with automatic prefix caching: stage 4's manager plus a prefix cache.

`PrefixCachingKVCacheManager` is `kvlab.paged.KVCacheManager` with two changes:

* `get_computed_blocks(request)` looks the request's tokens up block by block: the longest run of
  cached full blocks that starts them, capped so that at least one token is computed (its logits
  give the next token; vLLM v1's n - 1 cap). `allocate_slots` puts them at the front of the block
  table (ref count + 1; a free one leaves the free block queue) and allocates the rest.
* `allocate_slots` caches every block it fills, at admission or later in decode, when its slots
  are reserved, as vLLM v1 does: a request admitted later in the same step may hit a block whose
  K/V that step's forward pass has not written yet. That is correct because a block is readable
  from the pass that writes it on: the model runner writes the K/V of every token of a step, in
  each layer, before any token attends (`kvlab.serving.model_runner`).

`free` is stage 4's, tail first, but the blocks keep their cache entries until allocation reuses
them (LRU eviction, `prefix_cache`): a preempted request may hit its own blocks when admitted
again, which makes recompute much cheaper. Those hits are counted apart from first admissions', as
vLLM counts them (`PrefixCacheStats`): they are not prefixes shared with other requests. Each full
block is hashed once: the chain lives on the request (`request.kv_block_hashes`, vLLM v1's
`request.block_hashes`) from its first lookup until it finishes; a refused admission's retry hashes
nothing and only checks its hits are still cached. Tokens are read through `BlockTokens`
(`trace_blocks.block_tokens`): real ids in model mode, simulation's stand-ins otherwise. Forks (n >
1) share all blocks as in stage 4, the child inheriting the parent's record and chain;
copy-on-write only copies a partly filled block, which is never cached.

Sources: vLLM v1 KV cache manager (automatic prefix caching: full-block hashes chained through the
parent, an LRU free block queue, the n - 1 cap); SGLang RadixAttention (Zheng et al., "SGLang:
Efficient Execution of Structured Language Model Programs", 2024) for the same idea as a radix tree.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..paged.kv_cache_manager import KVCacheManager
from . import trace_blocks
from .block_hash import BlockHash, HashFunction, extra_keys_for, sha256
from .block_tokens import BlockTokens, as_block_tokens
from .prefix_cache import CachedBlock, CachingBlockPool, PrefixCache
from .views import PrefixCacheStats, PrefixManagerViews

__all__ = ["PrefixCachingKVCacheManager"]


class PrefixCachingKVCacheManager(PrefixManagerViews, KVCacheManager):
    """Block tables over a pool whose full blocks are cached by prefix. hash_fn: bytes -> bytes
    (default SHA-256); verify=False trusts the hash alone, as vLLM does, instead of confirming
    every hit against the stored tokens (only to show what a collision does)."""

    name = "paged+prefix"
    has_prefix_cache = True

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 hash_fn: HashFunction = sha256, verify: bool = True):
        super().__init__(num_blocks, block_size, max_model_len)
        self.prefix_cache = PrefixCache(verify=verify)
        self.pool = CachingBlockPool(num_blocks, self.prefix_cache)
        self.hash_fn = hash_fn
        # Per admitted request: its tokens, extra keys and chain of cached blocks.
        self._tokens: dict[Hashable, BlockTokens] = {}
        self._extra_keys: dict[Hashable, tuple] = {}
        self._chains: dict[Hashable, list[CachedBlock]] = {}
        # The last lookup of a request not admitted yet, for its admission (or its retry).
        self._lookups: dict[Hashable, tuple] = {}  # (tokens, extra keys, hits, hash chain)
        self._forked: set[Hashable] = set()  # requests whose chain is their parent's
        self._stats = PrefixCacheStats()

    # ---- lookup ------------------------------------------------------------------------------

    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """The cached blocks that start the request's tokens (n - 1 cap) and their token count."""
        tokens, extra_keys, known_hits = self._last_lookup(request)
        hashes = self._hashes(request)
        hits = self._lookup(tokens, extra_keys, True, hashes, known_hits)
        self._lookups[request.request_id] = (tokens, extra_keys, hits, hashes)
        return [entry.block_id for entry in hits], len(hits) * self.block_size

    def _last_lookup(self, request) -> tuple[BlockTokens, tuple, list[CachedBlock]]:
        """(tokens, extra keys, hits) of the request's last lookup if it still holds (a retry after
        a refused admission: the same tokens and hash chain), else read afresh, with no hits."""
        known = self._lookups.get(request.request_id)
        if (known is not None and known[3] is self._hashes(request)
                and len(known[0]) == request.num_tokens):
            return known[:3]
        return self.read_tokens(request), extra_keys_for(request.cache_salt), []

    def read_tokens(self, request) -> BlockTokens:
        """The request's tokens as the cache reads them (`trace_blocks.block_tokens`)."""
        return as_block_tokens(trace_blocks.block_tokens(request))

    @staticmethod
    def _hashes(request) -> list[BlockHash]:
        """The request's full-block hash chain (block i's at index i), created empty."""
        if getattr(request, "kv_block_hashes", None) is None:
            request.kv_block_hashes = []
        return request.kv_block_hashes

    def _block_hash(self, hashes: list[BlockHash], index: int, tokens: BlockTokens,
                    content: tuple, extra_keys: tuple) -> BlockHash:
        """Hash of full block `index`: from the chain when it is there, else computed from block
        index - 1's hash and appended (blocks are hashed in order)."""
        if index < len(hashes):
            return hashes[index]
        block_hash = tokens.block_hash(hashes[index - 1] if index else None, content,
                                       extra_keys, self.hash_fn)
        hashes.append(block_hash)
        return block_hash

    def _lookup(self, tokens: BlockTokens, extra_keys: tuple, count_collisions: bool,
                hashes: list[BlockHash], known_hits: Sequence[CachedBlock] = ()
                ) -> list[CachedBlock]:
        size = self.block_size
        max_blocks = (len(tokens) - 1) // size  # at least one token is computed
        # A known hit is found again while it is still cached: a bucket keeps insertion order,
        # so an entry stays the first one there with its parent and content until it is dropped.
        hits: list[CachedBlock] = []
        for entry in known_hits[:max_blocks]:
            if self.prefix_cache.entry(entry.block_id) is not entry:
                break
            hits.append(entry)
        parent: CachedBlock | None = hits[-1] if hits else None
        for index in range(len(hits), max_blocks):
            content = tokens.block(index, size)
            block_hash = self._block_hash(hashes, index, tokens, content, extra_keys)
            entry = self.prefix_cache.find(block_hash, content, extra_keys, parent)
            if entry is None:
                if count_collisions and self.prefix_cache.knows_hash(block_hash):
                    self._stats.num_collisions += 1
                break
            hits.append(entry)
            parent = entry
        return hits

    # ---- allocation: stage 4's, then cache the blocks it filled --------------------------------

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[int] = (),
                       full_sequence_must_fit: bool = False) -> list[int] | None:
        """As `KVCacheManager.allocate_slots`; every block it fills is cached."""
        rid = request.request_id
        table = self.tables.get(rid)
        if table is None:
            return self._admit(request, num_new_tokens, num_new_computed_tokens,
                               new_computed_blocks, full_sequence_must_fit)
        new_blocks = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                            new_computed_blocks)
        if new_blocks is not None:
            self.cache_blocks(request)  # if it filled a block
        return new_blocks

    def _admit(self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
               full_sequence_must_fit):
        rid = request.request_id
        tokens, extra_keys, _ = self._last_lookup(request)  # read afresh if it was not looked up
        chain = [self.prefix_cache.entry(block_id) for block_id in new_computed_blocks]
        if None in chain:
            raise ValueError(f"computed blocks {list(new_computed_blocks)} of request {rid!r} "
                             f"are not all cached")
        new_blocks = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                            new_computed_blocks, full_sequence_must_fit)
        if new_blocks is None:
            return None  # the lookup stays in _lookups for the retry
        self._lookups.pop(rid, None)
        self._tokens[rid], self._extra_keys[rid], self._chains[rid] = tokens, extra_keys, chain
        self.cache_blocks(request)
        stats = self._stats
        if getattr(request, "num_preemptions", 0):  # back after a preemption: counted apart
            stats.num_readmitted_lookups += 1
            stats.num_readmitted_query_tokens += len(tokens)
            stats.num_readmitted_hit_tokens += num_new_computed_tokens
        else:
            stats.num_lookups += 1
            stats.num_query_tokens += len(tokens)
            stats.num_hit_tokens += num_new_computed_tokens
            stats.num_hit_blocks += len(new_computed_blocks)
        return new_blocks

    def cache_blocks(self, request) -> None:
        """Give every full block of the request not yet in its chain a hash and a cache entry
        (vLLM v1's `cache_blocks`; `allocate_slots` calls it, and so does simulation's lazy
        replay for a request it advanced without calling `allocate_slots`)."""
        rid = request.request_id
        table, chain = self.tables[rid], self._chains[rid]
        if table.num_tokens // self.block_size <= len(chain):
            return  # no block filled since the last call: most decode steps
        tokens = self._tokens[rid]
        if table.num_tokens > len(tokens):  # record the ids of tokens it had not seen yet
            tokens.extend(trace_blocks.token_ids(request, len(tokens), table.num_tokens))
        extra_keys = self._extra_keys[rid]
        size, hashes = self.block_size, self._hashes(request)
        start, stop = len(chain), table.num_tokens // size
        contents = tokens.blocks(start, stop, size)
        # Blocks are hashed in order, and every block of the chain was hashed before it was
        # found or cached, so the hashes missing are those of some of these blocks.
        if len(hashes) < stop:
            hashes += tokens.chain_hashes(hashes[-1] if hashes else None,
                                          contents[len(hashes) - start:], extra_keys, self.hash_fn)
        chain += self.prefix_cache.insert_chain(table.block_ids[start:stop], hashes[start:stop],
                                                contents, extra_keys, chain[-1] if chain else None)

    def fork(self, parent, child) -> None:
        """As `KVCacheManager.fork`; the child inherits the parent's tokens, chain and hashes."""
        super().fork(parent, child)
        pid, cid = parent.request_id, child.request_id
        self._tokens[cid] = self._tokens[pid].copy()
        self._extra_keys[cid] = self._extra_keys[pid]
        self._chains[cid] = list(self._chains[pid])
        child.kv_block_hashes = list(self._hashes(parent))
        self._forked.add(cid)

    def free(self, request) -> None:
        """As `KVCacheManager.free` (tail first); the blocks stay cached until reused."""
        super().free(request)
        rid = request.request_id
        for per_request in (self._tokens, self._extra_keys, self._chains, self._lookups):
            per_request.pop(rid, None)
        if rid in self._forked:
            # Its chain was hashed over its parent's record of the tokens; admitted again, it is
            # looked up over its own (simulation's stand-in ids differ in the prompt's own id).
            self._forked.discard(rid)
            request.kv_block_hashes = []
