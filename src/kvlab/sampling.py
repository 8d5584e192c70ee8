"""Choosing the next token: greedy, or a sample whose randomness belongs to its request.

With temperature 0 the next token is the arg-max of the logits (greedy). With temperature T > 0 it
is drawn from softmax(logits / T). Each sequence draws from its *own* random stream, a
`torch.Generator`, so its samples do not depend on which other requests share its batch, on its
index in the batch, or on being preempted and recomputed.

Where a stream's seed comes from (vLLM's `SamplingParams.seed` works the same way):

* a request with its own seed: sibling s of that request (parallel sampling, n > 1) uses a stream
  derived from (seed, s) only. The same prompt with the same seed gives the same samples alone,
  first or tenth in a batch, through any KV cache.
* a request without a seed: its streams are derived from the engine's seed, the request's index
  and s, so two copies of one prompt still sample independently.

Streams are derived by hashing those numbers (SHA-256), so nearby seeds give unrelated streams.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["check_temperature", "stream_seed", "make_generator", "next_token"]


def check_temperature(temperature: float) -> float:
    """Refuse a temperature that is not a finite number >= 0 (0 = greedy).

    Raises:
        ValueError: the message names the value.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), "
                         f"got {temperature!r}")
    return float(temperature)


def stream_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from `parts` (e.g. ("request", seed, sibling)); same parts, same seed."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_generator(device: torch.device | str, *parts: int | str) -> torch.Generator:
    """A generator on `device` seeded with `stream_seed(*parts)`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(*parts))
    return generator


def next_token(logits: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None) -> int:
    """The next token id from one row of logits [vocab_size].

    temperature 0: arg-max (greedy; `generator` unused). temperature > 0: one sample from
    softmax(logits / temperature) computed in float32, drawn with `generator`.
    """
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
