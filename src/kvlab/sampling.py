"""Choosing the next token: greedy, or a sample whose randomness belongs to its request.

Temperature 0 is arg-max; T > 0 samples softmax(logits / T). Each sequence draws from its *own*
`torch.Generator`, so its samples do not depend on its batch, its index in it, or preemption. As
with vLLM's `SamplingParams.seed`: sibling s of a seeded request uses a stream from (seed, s) only,
the same alone or tenth in a batch, through any cache; an unseeded request's streams come from the
engine's seed, its index and s, so two copies of a prompt sample independently. Seeds are
SHA-256-hashed, so nearby seeds give unrelated streams.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["check_temperature", "stream_seed", "make_generator", "next_token"]


def check_temperature(temperature: float) -> float:
    """The temperature as a float; ValueError unless a finite number >= 0 (0 = greedy)."""
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
    """From logits [vocab_size]: arg-max at temperature 0, else a float32 softmax sample."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
