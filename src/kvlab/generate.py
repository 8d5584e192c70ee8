"""Generation of one request, with the KV cache of your choice: the course's one entry point.

cache="none" (stage 1: rerun the whole sequence each step), "contiguous" (stage 2: one max_model_len
slab), "paged" (stage 4: blocks of a shared pool) or "prefix" (stage 6: later prompts hit earlier
prompts' full blocks). With a cache the prompt runs once (prefill) and each later step feeds only
the newest token at its absolute position (decode). Greedy decoding picks the arg-max, so every
cache must give the same tokens: the course's first equivalence check; a sample draws from the
request's own seeded stream (`kvlab.sampling`), so it too is the same through every cache. `chat`
renders each user message with the model's chat template (as transformers' `apply_chat_template(...,
add_generation_prompt=True)`) and stops each reply at its end-of-turn token (SmolLM2's
`<|im_end|>`), without which an instruct model invents the next user message.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .contiguous import ContiguousKVCache
from .model import LlamaForCausalLM
from .paged import PagedKVCache
from .paged.backends import BackendLike
from .prefix.views import PrefixCacheStats
from .checks import check_int, check_model_len, check_request
from .sampling import check_temperature, make_generator, next_token, stop_token_ids
from .prefix.chats import render_chat
from .serving.llm_engine import EngineStats, generate_batch

__all__ = ["GenerationResult", "generate", "CACHE_KINDS", "default_cache", "ChatResult", "chat"]

CACHE_KINDS = ("none", "contiguous", "paged", "prefix")


@dataclasses.dataclass
class GenerationResult:
    """token_ids: the first completion, prompt excluded; completions: all n; prompt_completions:
    each prompt's. stats (`EngineStats`): "paged", "prefix"; prefix_stats: "prefix"; else None."""

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
    """Generate, greedy by default. 'paged' and 'prefix' take several prompts (one batch, admitted
    in order, so with 'prefix' each can hit its predecessors' blocks) and n > 1 completions sharing
    the prompt's blocks. max_model_len: at most (default) max_position_embeddings. eos_token_id:
    one stop id or several, the stop token returned last. seed: the request's stream, or with
    several prompts or 'prefix' the engine's (prompt i draws from (seed, i)). ValueError: a bad
    request, cache, temperature, seed or eos_token_id, or n > 1 or several prompts without paging;
    RequestTooLongError: prompt + max_new_tokens > max_model_len; KVCacheOutOfMemory."""
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
    """Contiguous for one prompt; paged for several (the one way to run them as a batch)."""
    return "contiguous" if num_prompts == 1 else "paged"


@dataclasses.dataclass
class ChatResult:
    """prompt_texts: each rendered conversation, ending where the reply begins; prompt_ids: what
    was prefilled; replies[p][i]: completion i of conversation p as text, stop token left out."""

    prompt_texts: list[str]
    prompt_ids: list[list[int]]
    replies: list[list[str]]
    generation: GenerationResult


def chat(model: LlamaForCausalLM, tokenizer, chat_template, user_messages: Sequence[str],
         max_new_tokens: int, *, system: str | None = None, cache: str | None = None,
         **options) -> ChatResult:
    """The reply to each user message, each its own conversation, as one batch. chat_template
    None (the tiny model): `render_chat`'s plain transcript, no stop token. system None keeps the
    template's default; options go to `generate`. ValueError: no message, or one not a str."""
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
