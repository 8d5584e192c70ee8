"""Generation of one request, with the KV cache of your choice: the course's one entry point.

    generate(model, prompt_ids, 20, cache="none")        # stage 1: recompute everything each step
    generate(model, prompt_ids, 20, cache="contiguous")  # stage 2: one max_model_len slab
    generate(model, prompt_ids, 20, cache="paged")       # stage 4: blocks from a shared pool
    generate(model, [prompt_a, prompt_b], 20, cache="prefix")  # stage 6: later prompts hit
                                                               # earlier prompts' full blocks
    chat(model, tokenizer, chat_template, ["What is the capital of France?"], 32)  # a reply

Without a cache every step runs the whole sequence through the model again (cost grows with the
position). With a cache the prompt is run once (prefill) and each later step feeds only the newest
token at its absolute position (decode), reading every earlier K/V from the cache. Greedy decoding
picks the arg-max token, so every path must produce the same tokens: the course's first
equivalence check. Sampling (temperature > 0) draws from the request's own seeded stream
(`kvlab.sampling`), so the same seed gives the same samples through every cache too.

This function owns the choice of cache; the `kvlab generate` command only parses and prints.

`chat` is the same generation for an instruct model: each user message is rendered into a prompt
with the model's own chat template (`kvlab.gguf_tokenizer.ChatTemplate`, as transformers'
`apply_chat_template(..., add_generation_prompt=True)` does), and each reply stops at the model's
end-of-turn token (`ChatTemplate.stop_token_ids`: SmolLM2's `<|im_end|>`). Without it an
instruct model's output runs on past its turn and makes up the next user message itself.
`kvlab generate --chat` and the notebooks call it.
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
from .checks import check_int, check_model_len, check_request
from .sampling import check_temperature, make_generator, next_token
from .serving.batch import generate_batch
from .prefix.chats import render_chat
from .serving.engine import EngineStats
from .serving.request import stop_token_ids

__all__ = ["GenerationResult", "generate", "CACHE_KINDS", "default_cache", "ChatResult", "chat"]

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
             eos_token_id: int | Sequence[int] | None = None, *, n: int = 1,
             temperature: float = 0.0,
             seed: int = 0, block_size: int = 16, num_blocks: int | None = None,
             attention_backend: BackendLike = None) -> GenerationResult:
    """Generate from one prompt (or, with the prefix cache, several): greedy by default.

    Args:
        model: the decoder.
        prompt_ids: prompt token ids; with cache='paged' or 'prefix' also a list of prompts,
            generated as one batch and admitted in the order given, so that with 'prefix' each
            can hit the full blocks of those before it.
        max_new_tokens: tokens to generate (fewer if a stop token comes first).
        cache: 'none' (recompute everything each step), 'contiguous' (one max_model_len slab),
            'paged' (blocks of `block_size` tokens; needed for n > 1, whose completions share
            the prompt's blocks) or 'prefix' (paged + automatic prefix caching, stage 6).
        max_model_len: longest sequence allowed (prompt + generated); default the model's
            max_position_embeddings, never more. The contiguous cache reserves exactly this many
            tokens; the paged pool is sized by `kvlab.serving.generate_batch`'s rule.
        eos_token_id: stop after this token, or after any of several (an instruct model's
            end-of-sequence and end-of-turn tokens); the stop token is the last one returned.
        n: completions of each prompt (cache='paged' or 'prefix' only).
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        seed: this request's sampling seed: the same prompt, seed and temperature give the same
            tokens through every cache (`kvlab.sampling`).
            With several prompts, or cache='prefix', it seeds the engine instead: prompt i
            draws from the stream of (seed, i), so two copies of one prompt still sample
            independently.
        block_size, num_blocks, attention_backend: the paged cache's (cache='paged'/'prefix').

    Returns:
        GenerationResult with the generated ids (int), the cache object and, for the paged cache,
        its stats (and the prefix cache's hit statistics for cache='prefix').

    Raises:
        ValueError: bad request (see `kvlab.checks.check_request`), max_model_len above the
            model's max_position_embeddings, unknown cache kind, n > 1 without a paged cache,
            several prompts without a paged cache, a bad temperature, seed or eos_token_id.
        RequestTooLongError (a ValueError): prompt + max_new_tokens > max_model_len.
        KVCacheOutOfMemory: the cache cannot be reserved.
    """
    config = model.config
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {cache!r}; choose from {', '.join(CACHE_KINDS)}")
    limit = check_model_len(config, max_model_len)
    several = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], (int, torch.Tensor))
    prompts = list(prompt_ids) if several else [prompt_ids]
    if several and cache not in ("paged", "prefix"):
        raise ValueError(f"{len(prompts)} prompts given: several prompts in one call are one "
                         f"batch, which needs cache='paged' or 'prefix' (cache={cache!r} holds "
                         f"one sequence)")
    for prompt in prompts:
        check_request(prompt, max_new_tokens, limit, config.vocab_size)
    temperature = check_temperature(temperature)
    seed = check_int("seed", seed, 0)
    stop = stop_token_ids(eos_token_id, config.vocab_size)
    check_int("n", n, 1)
    if cache in ("paged", "prefix"):
        # With the prefix cache or several prompts, prompt i draws from the stream of (seed, i);
        # with one prompt on the paged cache, the request's own seed decides (as without a cache).
        batch = generate_batch(
            model, prompts, max_new_tokens, block_size=block_size, num_blocks=num_blocks,
            max_model_len=max_model_len, n=n, eos_token_id=stop, temperature=temperature,
            seed=seed, seeds=None if cache == "prefix" or several else [seed],
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
            if generated[-1] in stop:
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
        if generated[-1] in stop:
            break
        # decode: only the new token, at the position right after the last one
        step_input, positions = tokens.new_tensor(generated[-1:]), positions[-1:] + 1
    return GenerationResult(generated, cache=kv_cache)


def default_cache(num_prompts: int) -> str:
    """The cache `chat` and `kvlab generate` use unless told: the contiguous cache of stage 2 for
    one prompt; the paged engine for several, the course's one way to run them as one batch."""
    return "contiguous" if num_prompts == 1 else "paged"


@dataclasses.dataclass
class ChatResult:
    """What `chat` produced.

    Attributes:
        prompt_texts: each conversation rendered by the chat template, ending where the reply
            begins.
        prompt_ids: those as token ids (what was prefilled).
        replies: replies[p][i] is completion i of conversation p as text, its stop token left out.
        generation: the `GenerationResult` (token ids with the stop token, cache, stats).
    """

    prompt_texts: list[str]
    prompt_ids: list[list[int]]
    replies: list[list[str]]
    generation: GenerationResult


def chat(model: LlamaForCausalLM, tokenizer, chat_template, user_messages: Sequence[str],
         max_new_tokens: int, *, system: str | None = None, cache: str | None = None,
         **options) -> ChatResult:
    """The assistant's reply to each user message, each its own conversation, as one batch.

    Args:
        model, tokenizer: the decoder and its `tokenizers.Tokenizer`.
        chat_template: a `kvlab.gguf_tokenizer.ChatTemplate`; replies stop at its
            stop_token_ids. None (a model without one, e.g. the tiny model): the plain transcript
            of `kvlab.prefix.chats.render_chat` and no stop token.
        user_messages: one user message per conversation.
        max_new_tokens: most tokens per reply (the stop token included).
        system: the system message; None keeps the template's own default (SmolLM2's names
            the model).
        cache: as `generate`; default `default_cache(len(user_messages))`.
        options: the rest of `generate`'s keywords (n, temperature, seed, max_model_len, ...).

    Raises:
        ValueError: no user message, a message that is not a str, and whatever `generate` raises.
    """
    if (isinstance(user_messages, str) or len(user_messages) == 0
            or not all(isinstance(m, str) for m in user_messages)):
        raise ValueError(f"chat needs one or more user messages (str), got {user_messages!r}")
    first = [{"role": "system", "content": system}] if system is not None else []
    texts = [render_chat(first + [{"role": "user", "content": message}], chat_template)
             for message in user_messages]
    prompts = [tokenizer.encode(text).ids for text in texts]
    stop = chat_template.stop_token_ids if chat_template is not None else frozenset()
    several = len(prompts) > 1
    result = generate(model, prompts if several else prompts[0], max_new_tokens,
                      cache=cache or default_cache(len(prompts)), eos_token_id=stop, **options)
    replies = [[tokenizer.decode([t for t in ids if t not in stop]) for ids in completions]
               for completions in result.prompt_completions]
    return ChatResult(texts, prompts, replies, result)
