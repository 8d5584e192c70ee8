"""What the KV cache buys in time: decoding measured per token, with and without a cache.

Without a cache, step i of generation feeds the whole sequence so far (P + i tokens) through the
model; with a cache the prompt is fed once (prefill) and every later step feeds one token (decode).
`tokens_fed` counts that work exactly; `time_decoding` measures the wall-clock cost of the same
greedy generation both ways, so a notebook can print the measured speed-up next to the arithmetic.
(Kwon et al., SOSP 2023, section 2.2, describe the prefill and decode phases.)
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
    """One way of generating, timed.

    Attributes:
        cache: 'none' or 'contiguous'.
        seconds_per_token: wall-clock seconds of the whole generation / tokens generated, the best
            (lowest) of the repeats: the least disturbed run on a shared machine.
        tokens_fed: tokens run through the model over the generation (`tokens_fed`).
        token_ids: the generated ids (identical for both caches: greedy decoding).
    """

    cache: str
    seconds_per_token: float
    tokens_fed: int
    token_ids: list[int]


def tokens_fed(prompt_len: int, new_tokens: int, cache: str) -> int:
    """Tokens run through the model to generate `new_tokens` after a prompt of `prompt_len`.

    'none': step i feeds P + i tokens, i = 0 .. G - 1: G x P + G (G - 1) / 2.
    'contiguous' (any KV cache): the prompt once, then one token per later step: P + G - 1.
    Example: P = 10, G = 100 -> 5,950 without a cache, 109 with one.

    Raises:
        ValueError: prompt_len or new_tokens < 1, or an unknown cache.
    """
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
    """Time the same greedy generation with each cache kind (on the model's device).

    Each kind runs once untimed (warm-up: allocator, kernels), then `repeats` timed runs; on a GPU
    the device is synchronised before the clock stops. max_model_len is prompt + max_new_tokens,
    so the contiguous slab is exactly as long as the request.

    Returns:
        {cache: DecodeTiming}. The measured speed-up of the cache is
        result["none"].seconds_per_token / result["contiguous"].seconds_per_token.

    Raises:
        ValueError: repeats < 1, a bad request or an unknown cache kind (from `generate`).
        RuntimeError: the caches generated different tokens (they must not: greedy decoding of the
            same model is deterministic up to float rounding, and the course checks they agree).
    """
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
