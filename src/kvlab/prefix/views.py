"""What the prefix cache saved, and what a learner prints of it; no step runs these.

`PrefixCachingKVCacheManager` inherits `PrefixManagerViews` (over stage 4's
`kvlab.paged.manager_views.ManagerViews`), so its file holds the verbs of a step only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..paged.manager_views import ManagerViews
from .block_hash import extra_keys_for, short
from .block_tokens import BlockTokens, as_block_tokens

if TYPE_CHECKING:
    from typing import Sequence

    from .prefix_cache import CachedBlock, CachingBlockPool, PrefixCache

__all__ = ["PrefixCacheStats", "PrefixManagerViews"]


@dataclasses.dataclass
class PrefixCacheStats:
    """What the prefix cache saved, in tokens and blocks (x bytes_per_token / block_bytes = bytes),
    counted at each admission as vLLM v1 counts (`vllm/v1/metrics/stats.py`, `PrefixCacheStats`):
    num_lookups, num_query_tokens, num_hit_tokens and num_hit_blocks are first admissions, whose
    hits over queries is the prefix cache hit rate (vLLM's `prefix_cache_hits` /
    `prefix_cache_queries`); the num_readmitted_* are re-admissions after a preemption (vLLM's
    `preempted_requests`, `preempted_queries`, `preempted_hits`, left out of its hit rate), which
    mostly find the request's own blocks, cached since the preemption freed them. Hit tokens are
    prefill tokens skipped, hit blocks neither allocated nor computed; num_collisions counts
    lookups whose hash matched an entry that the exact check refused."""

    num_lookups: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_hit_blocks: int = 0
    num_evictions: int = 0
    num_collisions: int = 0
    num_readmitted_lookups: int = 0
    num_readmitted_query_tokens: int = 0
    num_readmitted_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Prefix cache hit rate: tokens hit / tokens queried at first admissions (0 before any)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def readmitted_hit_rate(self) -> float | None:
        """Tokens hit / tokens queried at re-admissions after a preemption (None: none yet)."""
        if not self.num_readmitted_query_tokens:
            return None
        return self.num_readmitted_hit_tokens / self.num_readmitted_query_tokens

    @property
    def prefill_tokens_skipped(self) -> int:
        """Tokens not computed thanks to the cache, at first admissions and re-admissions."""
        return self.num_hit_tokens + self.num_readmitted_hit_tokens


class PrefixManagerViews(ManagerViews):
    """Stage 4's views plus the cache's: counts since start-up, free cached blocks."""

    pool: CachingBlockPool
    prefix_cache: PrefixCache
    _stats: PrefixCacheStats

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """A snapshot of the hit, saving and eviction counts since start-up."""
        self._stats.num_evictions = self.pool.num_evictions
        return dataclasses.replace(self._stats)

    def lookup(self, token_ids: Sequence[int] | BlockTokens,
               cache_salt: str | None = None) -> list[CachedBlock]:
        """The entries `get_computed_blocks` would find for these tokens; changes nothing (no ref
        counts, no LRU order, no statistics)."""
        return self._lookup(as_block_tokens(token_ids), extra_keys_for(cache_salt), False, [])

    def block_counts(self) -> dict[str, int]:
        """{'free': free and not cached, 'cached': free and cached (evictable, and hittable),
        'in_use': held}; they add up to the pool (a held block may also be cached: in use)."""
        blocks = self.pool.blocks
        cached = sum(1 for entry in self.prefix_cache.entries()
                     if blocks[entry.block_id].ref_count == 0)
        return {"free": self.pool.num_free_blocks - cached, "cached": cached,
                "in_use": self.pool.num_used_blocks}

    def format_block_tables(self) -> str:
        """Stage 4's picture plus the cache: each free cached block with its hash, LRU first."""
        lines = [super().format_block_tables()]
        cached = [block for block in self.pool.free_queue if block.block_id in self.prefix_cache]
        lines.append("cached and free (evicted first -> last): " + (" ".join(
            f"{b.block_id}:{short(self.prefix_cache.entry(b.block_id).block_hash)}"
            for b in cached) or "none"))
        return "\n".join(lines)
