"""What the KV cache buys in time: decoding measured per token, with and without a cache.

Without a cache step i feeds all P + i tokens so far; with one the prompt is fed once (prefill)
and each later step one token (decode; Kwon et al., SOSP 2023, section 2.2). `tokens_fed` counts
that work and `time_decoding` times it, so a notebook prints the speed-up beside the arithmetic.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from .generate import generate
from .model import LlamaForCausalLM

__all__ = ["DecodeTiming", "tokens_fed", "time_decoding"]


@dataclasses.dataclass
class DecodeTiming:
    """cache 'none' or 'contiguous'; seconds_per_token of the best repeat (the least disturbed on
    a shared machine); token_ids, identical for both caches (greedy)."""

    cache: str
    seconds_per_token: float
    tokens_fed: int
    token_ids: list[int]


def tokens_fed(prompt_len: int, new_tokens: int, cache: str) -> int:
    """'none': G x P + G (G - 1) / 2; 'contiguous' (any KV cache): P + G - 1. P = 10, G = 100:
    5,950 and 109. ValueError: a length < 1 or an unknown cache."""
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len and new_tokens must be >= 1, got {prompt_len}, {new_tokens}")
    if cache == "none":
        return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2
    if cache == "contiguous":
        return prompt_len + new_tokens - 1
    raise ValueError(f"unknown cache {cache!r}; use 'none' or 'contiguous'")


def time_decoding(model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int,
                  caches: Sequence[str] = ("none", "contiguous"),
                  repeats: int = 3) -> dict[str, DecodeTiming]:
    """{cache: DecodeTiming}: one warm-up and `repeats` timed runs each, the slab as long as the
    request. ValueError: repeats < 1, or from `generate`; RuntimeError: tokens differ."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    max_model_len = len(prompt_ids) + max_new_tokens
    timings: dict[str, DecodeTiming] = {}
    for cache in caches:
        result = generate(model, prompt_ids, max_new_tokens, cache=cache,
                          max_model_len=max_model_len)  # warm-up, and the tokens to compare
        best = float("inf")
        for _ in range(repeats):
            _synchronize(model)
            start = time.perf_counter()
            generate(model, prompt_ids, max_new_tokens, cache=cache, max_model_len=max_model_len)
            _synchronize(model)
            best = min(best, time.perf_counter() - start)
        generated = len(result.token_ids)
        timings[cache] = DecodeTiming(cache, best / generated,
                                      tokens_fed(len(prompt_ids), generated, cache),
                                      result.token_ids)
    outputs = {tuple(t.token_ids) for t in timings.values()}
    if len(outputs) > 1:
        raise RuntimeError(f"the caches generated different tokens: "
                           f"{ {c: t.token_ids[:8] for c, t in timings.items()} }")
    return timings


def _synchronize(model: LlamaForCausalLM) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
