"""A request's life in the KV cache: how many steps it stays, and how many tokens it holds at each.

One definition for `kvlab report`, the notebooks and the engine replay tests. A request of P prompt
tokens generating G: step 0 (prefill) writes P tokens' K/V and samples the first output; decode step
i (1 <= i < G) feeds the token sampled at i - 1, so the cache holds P + i; the step sampling token
G finishes the request, and that token is never fed back, so its K/V is never written. So it stays
S = max(G, 1) steps holding P, ..., P + S - 1 tokens, as vLLM reserves a token's slot in the step
that feeds it (Kwon et al., SOSP 2023, section 4.3; vLLM v1 `KVCacheManager.allocate_slots`).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["RequestSizes", "decode_steps", "tokens_held", "held_token_steps"]


class RequestSizes(Protocol):
    """Anything with a prompt length and an output length in tokens (e.g. `workload.Request`)."""

    prompt_len: int
    output_len: int


def decode_steps(request: RequestSizes) -> int:
    """S = max(G, 1): scheduler steps the request holds cache memory (its prefill included)."""
    return max(request.output_len, 1)


def tokens_held(request: RequestSizes) -> range:
    """Tokens in the cache at each step: P, ..., P + S - 1 (P = 3, G = 2 -> range(3, 5))."""
    return range(request.prompt_len, request.prompt_len + decode_steps(request))


def held_token_steps(request: RequestSizes) -> int:
    """Sum of `tokens_held` over the request's steps, in closed form: S * P + S * (S - 1) / 2."""
    steps = decode_steps(request)
    return steps * request.prompt_len + steps * (steps - 1) // 2
