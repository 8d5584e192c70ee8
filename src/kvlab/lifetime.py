"""A request's life in the KV cache: how many steps it stays, and how many tokens it holds at each.

One definition, shared by `kvlab report`, the notebooks and the tests that replay requests through
the engine (`kvlab.serving.LLMEngine`: the one scheduler with the paged KV manager). A request of
P prompt tokens that generates G tokens:

* Step 0 is the prefill: the K/V of the P prompt tokens are written and the first output token is
  sampled from the last position's logits. The cache holds P tokens.
* Step i (1 <= i < G) is a decode step: the token sampled at step i - 1 is fed in, its K/V written,
  and the next token sampled. The cache holds P + i tokens.
* After the step that samples token G the request finishes and frees its memory. That last token is
  returned to the user but never fed back, so its K/V is never written.

So the request stays S = max(G, 1) steps and holds P, P + 1, ..., P + S - 1 tokens (a prefill-only
request, G = 0, holds P for its one step). That is what vLLM's scheduler reserves too: the slot of a
token is reserved in the step that feeds it (Kwon et al., SOSP 2023, section 4.3; vLLM v1
`KVCacheManager.allocate_slots`).
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
    """Tokens in the cache at each of the request's steps: P, P + 1, ..., P + S - 1.

    Example: P = 3, G = 2 -> range(3, 5), i.e. 3 tokens at the prefill, 4 at the one decode step.
    """
    return range(request.prompt_len, request.prompt_len + decode_steps(request))


def held_token_steps(request: RequestSizes) -> int:
    """Sum of `tokens_held` over the request's steps, in closed form: S * P + S * (S - 1) / 2."""
    steps = decode_steps(request)
    return steps * request.prompt_len + steps * (steps - 1) // 2
