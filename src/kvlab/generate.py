"""Greedy generation, with and without a KV cache.

Without a cache every step runs the whole sequence through the model again (cost grows with the
position). With a cache the prompt is run once (prefill) and each later step feeds only the newest
token at its absolute position (decode), reading every earlier K/V from the cache. Greedy decoding
picks the arg-max token, so both paths must produce the same tokens: the course's first
equivalence check.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .contiguous import ContiguousKVCache
from .model import LlamaForCausalLM

__all__ = ["GenerationResult", "generate", "check_request", "CACHE_KINDS"]

CACHE_KINDS = ("none", "contiguous")


@dataclasses.dataclass
class GenerationResult:
    """token_ids: generated ids only (prompt excluded); cache: the KV cache used (None without)."""

    token_ids: list[int]
    cache: ContiguousKVCache | None = None


def check_request(prompt_ids: Sequence[int], max_new_tokens: int, max_model_len: int,
                  vocab_size: int) -> None:
    """Validate one request before any memory is touched.

    Raises:
        ValueError: an empty prompt, max_new_tokens < 1, a token id outside [0, vocab_size), or
            prompt + max_new_tokens > max_model_len (the message gives the numbers).
    """
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    total = len(prompt_ids) + max_new_tokens
    if total > max_model_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} = "
                         f"{total} tokens > max_model_len={max_model_len}")


@torch.inference_mode()
def generate(model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int,
             cache: str = "none", max_model_len: int | None = None,
             eos_token_id: int | None = None) -> GenerationResult:
    """Greedy decoding of one request.

    Args:
        model: the decoder.
        prompt_ids: prompt token ids.
        max_new_tokens: tokens to generate (fewer if `eos_token_id` comes first).
        cache: 'none' (recompute everything each step) or 'contiguous' (one max_model_len slab).
        max_model_len: longest sequence allowed (prompt + generated); default the model's
            max_position_embeddings. The contiguous cache reserves exactly this many tokens.

    Returns:
        GenerationResult with the generated ids (int) and the cache object.

    Raises:
        ValueError: bad request (see `check_request`) or unknown cache kind.
    """
    config = model.config
    max_model_len = max_model_len or config.max_position_embeddings
    check_request(prompt_ids, max_new_tokens, max_model_len, config.vocab_size)
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {cache!r}; choose from {', '.join(CACHE_KINDS)}")
    device = model.device
    tokens = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    generated: list[int] = []

    if cache == "none":
        for _ in range(max_new_tokens):
            next_token = model(tokens)[-1].argmax()
            generated.append(int(next_token))
            if generated[-1] == eos_token_id:
                break
            tokens = torch.cat([tokens, next_token.view(1)])
        return GenerationResult(generated)

    kv_cache = ContiguousKVCache(config, max_num_seqs=1, max_model_len=max_model_len,
                                 dtype=model.dtype, device=device)
    slab = kv_cache.add_sequence()
    store = kv_cache.view(slab)
    positions = torch.arange(len(tokens), device=device)
    step_input = tokens  # prefill: the whole prompt at positions 0 .. P-1
    for _ in range(max_new_tokens):
        next_token = model(step_input, positions, store)[-1].argmax()
        generated.append(int(next_token))
        if generated[-1] == eos_token_id:
            break
        # decode: only the new token, at the position right after the last one
        step_input, positions = next_token.view(1), positions[-1:] + 1
    return GenerationResult(generated, kv_cache)
