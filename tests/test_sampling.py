"""Sampling reproducible per request: a seed belongs to its request, not to its place in a batch."""

from __future__ import annotations

import pytest
import torch

from kvlab.generate import generate
from kvlab.serving import generate_batch
from kvlab.sampling import check_temperature, make_generator, next_token, stream_seed

PROMPT, OTHERS, NEW = [5, 9, 3, 7], [[1, 2, 3, 4, 5, 6], [8], [40, 41]], 12
SAMPLE = dict(temperature=1.5, block_size=4)


def test_same_prompt_and_seed_give_the_same_samples_wherever_it_sits(small_llama):
    alone = generate_batch(small_llama, [PROMPT], NEW, seeds=[42], **SAMPLE).token_ids[0]
    second = generate_batch(small_llama, [OTHERS[0], PROMPT] + OTHERS[1:], NEW,
                            seeds=[1, 42, 2, 3], **SAMPLE).token_ids[1]
    last = generate_batch(small_llama, OTHERS + [PROMPT], NEW, seeds=[None, None, None, 42],
                          **SAMPLE).token_ids[3]
    assert alone == second == last
    # ... and through every cache of `generate` (the same stream as sibling 0 of the request).
    for cache in ("none", "contiguous", "paged"):
        tokens = generate(small_llama, PROMPT, NEW, cache=cache, temperature=1.5, seed=42).token_ids
        assert tokens == alone


def test_the_seed_matters(small_llama):
    samples = {tuple(generate(small_llama, PROMPT, NEW, cache="contiguous", temperature=1.5,
                              seed=seed).token_ids) for seed in range(4)}
    assert len(samples) > 1


def test_copies_without_their_own_seed_sample_independently(small_llama):
    result = generate_batch(small_llama, [PROMPT] * 3, NEW, **SAMPLE)
    assert len({tuple(tokens) for tokens in result.token_ids}) == 3
    # Two copies with the same seed are the same request twice: the same samples.
    twins = generate_batch(small_llama, [PROMPT] * 2, NEW, seeds=[7, 7], **SAMPLE)
    assert twins.token_ids[0] == twins.token_ids[1]


def test_siblings_of_a_seeded_request_differ_and_are_reproducible(small_llama):
    first = generate(small_llama, PROMPT, NEW, cache="paged", n=3, temperature=1.5, seed=5)
    again = generate(small_llama, PROMPT, NEW, cache="paged", n=3, temperature=1.5, seed=5)
    assert first.completions == again.completions
    assert len({tuple(c) for c in first.completions}) > 1


def test_n_needs_the_paged_cache(small_llama):
    with pytest.raises(ValueError, match="n=2 completions need cache='paged'"):
        generate(small_llama, PROMPT, 2, cache="contiguous", n=2, temperature=1.0)


def test_stream_seeds_are_deterministic_and_distinct():
    assert stream_seed("request", 1, 0) == stream_seed("request", 1, 0)
    seeds = {stream_seed("request", seed, sibling) for seed in range(50) for sibling in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    a, b = make_generator("cpu", "request", 3, 0), make_generator("cpu", "request", 3, 0)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_greedy_is_arg_max_and_temperatures_are_checked():
    logits = torch.tensor([0.1, 3.0, -1.0])
    assert next_token(logits, 0.0) == 1
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            check_temperature(bad)
