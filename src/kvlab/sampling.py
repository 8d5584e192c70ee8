"""Choosing the next token: greedy, or a sample whose randomness belongs to its request.

A request's `SamplingParams` (vLLM's name) say what to do with its logits: temperature 0 is
arg-max, T > 0 samples softmax(logits / T). Each sequence draws from its *own* `torch.Generator`,
so its samples do not depend on its batch, its index in it, or preemption. As with vLLM's
`SamplingParams.seed`, sibling s of a seeded request uses a stream from (seed, s) only, the same
alone or tenth in a batch, through any cache; an unseeded request's come from the engine's seed,
its index and s, so two copies of a prompt sample independently. Seeds are SHA-256-hashed: nearby
seeds give unrelated streams. A request ends after any of its stop tokens: an instruct model ends
a reply with its end-of-turn token (SmolLM2's `<|im_end|>`, Llama 3's `<|eot_id|>`), which may
differ from its end-of-sequence token, hence a set of stop token ids, as vLLM's
`SamplingParams.stop_token_ids`, HF's list-valued `GenerationConfig.eos_token_id` and llama.cpp's
end-of-generation ids.

torch is imported inside the two functions that make a generator or a sample: simulation imports
`SamplingParams` and never samples (why it matters: `kvlab.lazy_import`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING

from .checks import check_int

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "GREEDY", "stop_token_ids", "check_temperature", "stream_seed",
           "make_generator", "next_token"]


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
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(*parts))
    return generator


def next_token(logits: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None) -> int:
    """From logits [vocab_size]: arg-max at temperature 0, else a float32 softmax sample."""
    if temperature == 0:
        return int(logits.argmax())
    import torch

    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM's `SamplingParams`, cut down. stream_seed: the request's own stream, None when greedy;
    stop_token_ids (any iterable, kept as a frozenset): finish ("stop") right after sampling one,
    else at max_output_tokens ("length"); first_token: forced (the course's way to make greedy
    siblings diverge, so copy-on-write shows). ValueError: a temperature not a finite number >= 0
    or > 0 without a stream_seed; a token id not an integer >= 0."""

    temperature: float = 0.0
    stream_seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    first_token: int | None = None

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.temperature > 0 and self.stream_seed is None:
            # Without it every such request would draw from one default stream: identical samples.
            raise ValueError(f"temperature={self.temperature} needs a stream_seed (e.g. "
                             f"kvlab.sampling.stream_seed('request', seed, sibling))")
        if isinstance(self.stop_token_ids, (int, str)):  # one id where a set belongs: say so
            raise ValueError(f"stop_token_ids must be a collection of token ids, got "
                             f"{self.stop_token_ids!r} (write {{{self.stop_token_ids!r}}})")
        # frozen: the normalised set is written once, here, through object.__setattr__
        object.__setattr__(self, "stop_token_ids", frozenset(
            _token_id("stop_token_ids entry", t) for t in self.stop_token_ids))
        if self.first_token is not None:
            _token_id("first_token", self.first_token)


def _token_id(name: str, value) -> int:
    """A token id >= 0, else ValueError (no vocabulary bound here: the engine checks that)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a token id >= 0, got {value!r}")
    return value


GREEDY = SamplingParams()


def stop_token_ids(eos_token_id, vocab_size: int) -> frozenset[int]:
    """The stop set of a request from an `eos_token_id` argument: None, one id, or several ids
    (as HF's `GenerationConfig.eos_token_id`); ValueError for an id outside [0, vocab_size)."""
    if eos_token_id is None:
        return frozenset()
    several = isinstance(eos_token_id, (list, tuple, set, frozenset))
    ids = list(eos_token_id) if several else [eos_token_id]
    return frozenset(check_int("eos_token_id", t, 0, vocab_size - 1) for t in ids)
