"""One call for a whole batch: `generate_batch` runs prompts through an `LLMEngine` to the end.

It sizes the pool (by default big enough that nothing is preempted), queues every prompt, rejects
the ones that can never be served without stopping the others, runs the engine and collects the
completions and the engine's counts. Stage 4 calls it with the paged cache, stage 6 with
`enable_prefix_caching=True`; `kvlab.generate.generate` is the one-prompt front door.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence as Seq

from ..errors import RequestTooLongError
from ..paged.backends import BackendLike
from ..paged.block_table import cdiv
from ..paged.paged_cache import PagedKVCache
from ..prefix.block_hash import HashFunction, sha256
from ..prefix.manager import PrefixCacheStats
from ..checks import check_int
from .engine import EngineStats, LLMEngine

__all__ = ["BatchResult", "generate_batch", "default_pool_size"]


@dataclasses.dataclass
class BatchResult:
    """Output of `generate_batch`.

    Attributes:
        token_ids: per prompt, the generated ids of its first completion ([] if rejected).
        completions: per prompt, the generated ids of each of its n completions.
        errors: per prompt, None or the message of the error (e.g. RequestTooLongError) that
            rejected it.
        stats: preemptions, peak blocks in use, blocks saved by sharing, copy-on-write copies.
        prefix_stats: prefix cache hit rate, blocks not computed, prefill tokens skipped,
            evictions (with enable_prefix_caching; else None).
        cache: the PagedKVCache used (every block is free again at the end).
    """

    token_ids: list[list[int]]
    completions: list[list[list[int]]]
    errors: list[str | None]
    stats: EngineStats
    prefix_stats: PrefixCacheStats | None
    cache: PagedKVCache


def generate_batch(model, prompts: Seq[Seq[int]], max_new_tokens: int | Seq[int],
                   block_size: int = 16, num_blocks: int | None = None,
                   max_model_len: int | None = None, n: int = 1,
                   eos_token_id: int | Seq[int] | None = None, max_num_seqs: int = 256,
                   first_tokens: Seq[Seq[int] | None] | None = None, temperature: float = 0.0,
                   seed: int = 0, seeds: Seq[int | None] | None = None,
                   cache_salts: Seq[str | None] | None = None,
                   enable_prefix_caching: bool = False, hash_fn: HashFunction = sha256,
                   attention_backend: BackendLike = None) -> BatchResult:
    """Generate for a batch of prompts at once through a paged KV cache (greedy by default).

    Prompts are admitted in order, so with prefix caching a prompt can hit the blocks of any
    earlier one that is running or whose blocks were not reused since.

    Args:
        model: the decoder.
        prompts: token ids of each prompt (lengths may differ).
        max_new_tokens: tokens per completion, one int for all or one per prompt.
        block_size: tokens per block.
        num_blocks: pool size; default enough for every completion at full length (nothing is
            preempted). A small pool forces preemption.
        max_model_len: longest request allowed; default min(max_position_embeddings, the longest
            request) when num_blocks is None, else min(max_position_embeddings, num_blocks x
            block_size).
        n: completions per prompt (parallel sampling, prompt blocks shared).
        eos_token_id: stop a completion after this token (or any of several; see `LLMEngine`).
        max_num_seqs: most sequences running at once.
        first_tokens: per prompt None or n forced first tokens, one per completion.
        temperature, seed: sampling (0 = greedy); see `LLMEngine`.
        seeds: per prompt None or its own sampling seed (see `LLMEngine.add_request`).
        cache_salts: per prompt None or its tenant's salt (prefix caching).
        enable_prefix_caching, hash_fn: stage 6's prefix cache and its block hash.
        attention_backend: see `kvlab.paged.backends`.

    Returns:
        BatchResult. A rejected prompt (too long, empty, bad token ids or salt: any error of
        `add_request`) gets [] and an error message; the other prompts are generated as if they
        were alone: one bad request never takes down the others.

    Raises:
        KVCacheOutOfMemory: the pool cannot hold one max_model_len request.
        ValueError: malformed arguments of the whole call (no prompts, mismatched list lengths,
            max_model_len > max_position_embeddings, bad sizes).
    """
    if len(prompts) == 0:
        raise ValueError("generate_batch needs at least one prompt")
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    for name, values in (("max_new_tokens", max_new_tokens), ("first_tokens", first_tokens),
                         ("seeds", seeds), ("cache_salts", cache_salts)):
        if values is not None and len(values) != len(prompts):
            raise ValueError(f"{len(values)} {name} entries for {len(prompts)} prompts")
    max_new_tokens = [check_int("max_new_tokens", new, 1) for new in max_new_tokens]
    check_int("n (at most max_num_seqs)", n, 1, check_int("max_num_seqs", max_num_seqs, 1))
    lengths = [len(prompt) + new for prompt, new in zip(prompts, max_new_tokens)]
    max_model_len, num_blocks = default_pool_size(model, lengths, n, block_size, max_model_len,
                                                  num_blocks)
    engine = LLMEngine(model, num_blocks, block_size, max_model_len, max_num_seqs, eos_token_id,
                       temperature, seed, attention_backend, enable_prefix_caching, hash_fn)

    def per_prompt(values, index):
        return None if values is None else values[index]

    request_ids: list[int | None] = []
    errors: list[str | None] = []
    for index, (prompt, new) in enumerate(zip(prompts, max_new_tokens)):
        try:
            request_ids.append(engine.add_request(
                prompt, new, n, per_prompt(first_tokens, index), per_prompt(seeds, index),
                per_prompt(cache_salts, index)))
            errors.append(None)
        except (ValueError, TypeError, RequestTooLongError) as error:
            request_ids.append(None)
            errors.append(f"prompt {index}: {error}")
    engine.run()
    completions = [engine.outputs(rid) if rid is not None else [[] for _ in range(n)]
                   for rid in request_ids]
    return BatchResult([c[0] for c in completions], completions, errors, engine.stats,
                       engine.prefix_stats, engine.cache)


def default_pool_size(model, lengths: list[int], n: int, block_size: int,
                      max_model_len: int | None, num_blocks: int | None) -> tuple[int, int]:
    """The batch defaults: (max_model_len, num_blocks) in tokens and blocks.

    max_model_len defaults to the longest request (prompt + max_new_tokens, in tokens), or what
    the given pool holds, capped at the model's max_position_embeddings; num_blocks defaults to
    room for every completion at once, so nothing needs preemption unless the caller asks for it.
    """
    if max_model_len is None:
        max_model_len = min(model.config.max_position_embeddings,
                            max(lengths) if num_blocks is None else num_blocks * block_size)
    if num_blocks is None:
        per_sequence = [cdiv(min(length, max_model_len), block_size) for length in lengths]
        num_blocks = max(cdiv(max_model_len, block_size), n * sum(per_sequence))
    return max_model_len, num_blocks
