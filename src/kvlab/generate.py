"""Generation of one request, with the KV cache of your choice: the course's one entry point.

    generate(model, prompt_ids, 20, cache="none")        # stage 1: recompute everything each step
    generate(model, prompt_ids, 20, cache="contiguous")  # stage 2: one max_model_len slab
    generate(model, prompt_ids, 20, cache="paged")       # stage 4: blocks from a shared pool
    generate(model, [prompt_a, prompt_b], 20, cache="prefix")  # stage 6: later prompts hit
                                                               # earlier prompts' full blocks

Without a cache every step runs the whole sequence through the model again (cost grows with the
position). With a cache the prompt is run once (prefill) and each later step feeds only the newest
token at its absolute position (decode), reading every earlier K/V from the cache. Greedy decoding
picks the arg-max token, so every path must produce the same tokens: the course's first
equivalence check. Sampling (temperature > 0) draws from the request's own seeded stream
(`kvlab.sampling`), so the same seed gives the same samples through every cache too.

This function owns the choice of cache; the `kvlab generate` command only parses and prints.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .contiguous import ContiguousKVCache
from .model import LlamaForCausalLM
from .paged import PagedKVCache
from .paged.backends import BackendLike
from .prefix.manager import PrefixCacheStats
from .requests import check_int, check_model_len, check_request
from .sampling import check_temperature, make_generator, next_token
from .serving.batch import generate_batch
from .serving.engine import EngineStats

__all__ = ["GenerationResult", "generate", "CACHE_KINDS"]

CACHE_KINDS = ("none", "contiguous", "paged", "prefix")


@dataclasses.dataclass
class GenerationResult:
    """What `generate` produced.

    Attributes:
        token_ids: generated ids of the (first) completion, prompt excluded.
        completions: generated ids of each of the n completions ([token_ids] when n = 1).
        cache: the KV cache used (None without one).
        stats: the engine's counts (`kvlab.serving.EngineStats`: (preemptions, peak blocks, blocks saved by sharing,
            copy-on-write copies, prefill tokens run) for cache="paged" or "prefix", else None.
            Those caches run through `kvlab.serving.LLMEngine`, the course's one scheduler.
        prefix_stats: prefix cache hit rate, blocks not computed, prefill tokens skipped and
            evictions for cache="prefix", else None.
        prompt_completions: the completions of every prompt, in the order given
            ([completions] for one prompt).
    """

    token_ids: list[int]
    completions: list[list[int]] = dataclasses.field(default_factory=list)
    cache: ContiguousKVCache | PagedKVCache | None = None
    stats: EngineStats | None = None
    prefix_stats: PrefixCacheStats | None = None
    prompt_completions: list[list[list[int]]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.completions:
            self.completions = [self.token_ids]
        if not self.prompt_completions:
            self.prompt_completions = [self.completions]


@torch.inference_mode()
def generate(model: LlamaForCausalLM, prompt_ids: Sequence[int] | Sequence[Sequence[int]],
             max_new_tokens: int,
             cache: str = "none", max_model_len: int | None = None,
             eos_token_id: int | None = None, *, n: int = 1, temperature: float = 0.0,
             seed: int = 0, block_size: int = 16, num_blocks: int | None = None,
             attention_backend: BackendLike = None) -> GenerationResult:
    """Generate from one prompt (or, with the prefix cache, several): greedy by default.

    Args:
        model: the decoder.
        prompt_ids: prompt token ids; with cache='prefix' also a list of prompts, admitted in
            the order given so that each can hit the full blocks of those before it.
        max_new_tokens: tokens to generate (fewer if `eos_token_id` comes first).
        cache: 'none' (recompute everything each step), 'contiguous' (one max_model_len slab),
            'paged' (blocks of `block_size` tokens; needed for n > 1, whose completions share
            the prompt's blocks) or 'prefix' (paged + automatic prefix caching, stage 6).
        max_model_len: longest sequence allowed (prompt + generated); default the model's
            max_position_embeddings, never more. The contiguous cache reserves exactly this many
            tokens; the paged pool is sized by `kvlab.serving.generate_batch`'s rule.
        eos_token_id: stop after this token.
        n: completions of each prompt (cache='paged' or 'prefix' only).
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        seed: this request's sampling seed: the same prompt, seed and temperature give the same
            tokens through every cache (`kvlab.sampling`).
            With cache='prefix' it seeds the engine instead: prompt i draws from the stream of
            (seed, i), so two copies of one prompt still sample independently.
        block_size, num_blocks, attention_backend: the paged cache's (cache='paged'/'prefix').

    Returns:
        GenerationResult with the generated ids (int), the cache object and, for the paged cache,
        its stats (and the prefix cache's hit statistics for cache='prefix').

    Raises:
        ValueError: bad request (see `kvlab.requests.check_request`), max_model_len above the
            model's max_position_embeddings, unknown cache kind, n > 1 without a paged cache,
            several prompts without cache='prefix', a bad temperature, seed or eos_token_id.
        RequestTooLongError (a ValueError): prompt + max_new_tokens > max_model_len.
        KVCacheOutOfMemory: the cache cannot be reserved.
    """
    config = model.config
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {cache!r}; choose from {', '.join(CACHE_KINDS)}")
    limit = check_model_len(config, max_model_len)
    several = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], (int, torch.Tensor))
    prompts = list(prompt_ids) if several else [prompt_ids]
    if several and cache != "prefix":
        raise ValueError(f"{len(prompts)} prompts given: several prompts in one call need "
                         f"cache='prefix' (later prompts hit the blocks of earlier ones)")
    for prompt in prompts:
        check_request(prompt, max_new_tokens, limit, config.vocab_size)
    temperature = check_temperature(temperature)
    seed = check_int("seed", seed, 0)
    if eos_token_id is not None:
        check_int("eos_token_id", eos_token_id, 0, config.vocab_size - 1)
    check_int("n", n, 1)
    if cache in ("paged", "prefix"):
        # With the prefix cache, prompt i draws from the stream of (seed, i); with one prompt
        # on the paged cache, the request's own seed decides (as without a cache).
        batch = generate_batch(
            model, prompts, max_new_tokens, block_size=block_size, num_blocks=num_blocks,
            max_model_len=max_model_len, n=n, eos_token_id=eos_token_id, temperature=temperature,
            seed=seed, seeds=None if cache == "prefix" else [seed],
            enable_prefix_caching=cache == "prefix", attention_backend=attention_backend)
        for error in batch.errors:  # cannot happen after check_request; nothing stays silent
            if error:
                raise ValueError(error)
        return GenerationResult(batch.token_ids[0], batch.completions[0], batch.cache,
                                batch.stats, batch.prefix_stats, batch.completions)
    if n != 1:
        raise ValueError(f"n={n} completions need cache='paged' (they share the prompt's "
                         f"blocks); cache={cache!r} generates one")

    # The same stream as completion 0 of a seeded request in `kvlab.serving.LLMEngine`.
    generator = make_generator(model.device, "request", seed, 0) if temperature > 0 else None
    device = model.device
    tokens = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    generated: list[int] = []

    if cache == "none":
        for _ in range(max_new_tokens):
            generated.append(next_token(model(tokens)[-1], temperature, generator))
            if generated[-1] == eos_token_id:
                break
            tokens = torch.cat([tokens, tokens.new_tensor(generated[-1:])])
        return GenerationResult(generated)

    kv_cache = ContiguousKVCache(config, max_num_seqs=1, max_model_len=limit,
                                 dtype=model.dtype, device=device)
    store = kv_cache.view(kv_cache.add_sequence())
    positions = torch.arange(len(tokens), device=device)
    step_input = tokens  # prefill: the whole prompt at positions 0 .. P-1
    for _ in range(max_new_tokens):
        generated.append(next_token(model(step_input, positions, store)[-1], temperature, generator))
        if generated[-1] == eos_token_id:
            break
        # decode: only the new token, at the position right after the last one
        step_input, positions = tokens.new_tensor(generated[-1:]), positions[-1:] + 1
    return GenerationResult(generated, cache=kv_cache)
