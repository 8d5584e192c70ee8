"""The paged engine with automatic prefix caching: admission looks the prompt up, prefill starts
after the hit.

`PrefixCachingEngine` is stage 4's `PagedEngine` (continuous batching, preemption by recompute,
forks for n > 1) on a `PrefixCachingKVCacheManager`. It overrides two small methods; the scheduler
itself is inherited:

* `_allocate_prompt` (admission) calls `allocate_with_prefix`, which shares the cached prefix
  blocks and reserves slots only for the rest, and returns `num_cached_tokens` as the position
  where prefill starts: the engine then runs only positions num_cached_tokens .. len(tokens) - 1,
  at their absolute positions (RoPE needs them), attending over the cached blocks as if it had
  computed them itself (vLLM's num_computed_tokens);
* `_reserve_next_slot` names the token it appends, so a block filled during decode is hashed
  and cached the moment it is full.

A preempted sequence is admitted again like any other, so it may hit the blocks it held itself
(if nothing reused them in between): recompute preemption becomes much cheaper.

Sources: vLLM v1 (the scheduler asks the KV cache manager for computed blocks, then schedules only
the uncomputed tokens); SGLang RadixAttention (the same for a radix tree).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence as Seq

import torch

from ..errors import RequestTooLongError
from ..model import LlamaForCausalLM
from ..paged.backends import BackendLike
from ..paged.batch import default_pool_size, run_requests
from ..paged.engine import PagedEngine, PagedStats, Sequence
from ..paged.paged_cache import PagedKVCache
from .block_hash import HashFunction, extra_keys_for, sha256
from .manager import PrefixCacheStats, PrefixCachingKVCacheManager

__all__ = ["PrefixCachingEngine", "PrefixGenerationResult", "generate_with_prefix_cache"]


class PrefixCachingEngine(PagedEngine):
    """`PagedEngine` whose pool caches full blocks by prefix (see the module doc).

    Args: those of `PagedEngine`, plus
        hash_fn: the block hash function (default SHA-256).

    Attributes:
        prefix_stats: hit rate, blocks saved, prefill tokens skipped, evictions so far.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 eos_token_id: int | None = None, temperature: float = 0.0, seed: int = 0,
                 attention_backend: BackendLike = None, hash_fn: HashFunction = sha256):
        super().__init__(model, num_blocks, block_size, max_model_len, max_num_seqs,
                         eos_token_id, temperature, seed, attention_backend)
        # The pool tensors do not care which manager names their blocks: swap in the caching one
        # before any block is handed out.
        self.manager = PrefixCachingKVCacheManager(num_blocks, block_size, hash_fn)
        self.cache.manager = self.manager
        self._salts: list[str | None] = []         # request_id -> cache_salt

    def add_request(self, prompt: Seq[int], max_new_tokens: int, n: int = 1,
                    first_tokens: Seq[int] | None = None, seed: int | None = None,
                    cache_salt: str | None = None) -> int:
        """As `PagedEngine.add_request`; `cache_salt` keeps this request's blocks to its tenant.

        Raises:
            TypeError: cache_salt is not a str. Others: see `PagedEngine.add_request`.
        """
        extra_keys_for(cache_salt)  # validate before the request is queued
        request_id = super().add_request(prompt, max_new_tokens, n, first_tokens, seed)
        self._salts.append(cache_salt)
        return request_id

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.manager.prefix_stats

    def _reserve_next_slot(self, seq: Sequence) -> int:
        """The slot of the token fed back this step, named so a block it fills is cached at once."""
        reservation = self.manager.append_slots(seq.seq_id, 1, [seq.output[-1]])
        for src, dst in reservation.copies:  # copy-on-write of a shared partial block
            self.cache.copy_block(src, dst)
        return reservation.slots[0]

    def _allocate_prompt(self, seq: Sequence) -> tuple[torch.Tensor, int]:
        """Share the cached prefix, reserve slots for the rest; prefill starts after the hit."""
        allocation = self.manager.allocate_with_prefix(seq.seq_id, seq.tokens,
                                                       self._salts[seq.seq_id[0]])
        slots = torch.tensor(allocation.slots, dtype=torch.long, device=self.cache.device)
        return slots, allocation.num_cached_tokens


@dataclasses.dataclass
class PrefixGenerationResult:
    """Output of `generate_with_prefix_cache`: as `PagedGenerationResult`, plus `prefix_stats`."""

    token_ids: list[list[int]]
    completions: list[list[list[int]]]
    errors: list[str | None]
    stats: PagedStats
    prefix_stats: PrefixCacheStats
    cache: PagedKVCache


def generate_with_prefix_cache(model: LlamaForCausalLM, prompts: Seq[Seq[int]],
                               max_new_tokens: int | Seq[int], block_size: int = 16,
                               num_blocks: int | None = None, max_model_len: int | None = None,
                               n: int = 1, eos_token_id: int | None = None,
                               max_num_seqs: int = 256, temperature: float = 0.0, seed: int = 0,
                               cache_salts: Seq[str | None] | None = None,
                               hash_fn: HashFunction = sha256,
                               attention_backend: BackendLike = None) -> PrefixGenerationResult:
    """Generate for a batch of prompts through a prefix-caching paged KV cache (greedy by default).

    Prompts are admitted in order, so a prompt can hit the blocks of any earlier one that is
    running or whose blocks were not reused since. Arguments as `kvlab.paged.generate_paged`, plus
    cache_salts (per prompt None or a tenant's salt) and hash_fn.

    Returns:
        PrefixGenerationResult. A rejected prompt (any ValueError of `add_request`) gets [] and
        an error message; the others run.

    Raises:
        KVCacheOutOfMemory: the pool cannot hold one max_model_len request.
        ValueError: no prompts, mismatched list lengths, bad sizes.
    """
    if len(prompts) == 0:
        raise ValueError("generate_with_prefix_cache needs at least one prompt")
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    for name, values in (("max_new_tokens", max_new_tokens), ("cache_salts", cache_salts)):
        if values is not None and len(values) != len(prompts):
            raise ValueError(f"{len(values)} {name} for {len(prompts)} prompts")
    lengths = [len(prompt) + new for prompt, new in zip(prompts, max_new_tokens)]
    max_model_len, num_blocks = default_pool_size(model, lengths, n, block_size, max_model_len,
                                                  num_blocks)  # the same defaults as generate_paged
    engine = PrefixCachingEngine(model, num_blocks, block_size, max_model_len, max_num_seqs,
                                 eos_token_id, temperature, seed, attention_backend, hash_fn)
    submissions = [functools.partial(engine.add_request, prompt, new, n,
                                     cache_salt=None if cache_salts is None else cache_salts[index])
                   for index, (prompt, new) in enumerate(zip(prompts, max_new_tokens))]
    completions, errors = run_requests(engine, submissions, n,
                                       rejected=(ValueError, TypeError, RequestTooLongError))
    return PrefixGenerationResult([c[0] for c in completions], completions, errors,
                                  engine.stats, engine.prefix_stats, engine.cache)
