"""kvlab.generate: request validation, stopping, and greedy decoding against a hand-rolled loop."""

from __future__ import annotations

import pytest
import torch

from kvlab.generate import CACHE_KINDS, generate
from kvlab.checks import check_request

PROMPT = [11, 22, 33, 44]


def manual_greedy(hf_model, prompt, max_new_tokens):
    """Greedy decoding spelled out over the HF model's full-sequence logits (no cache at all)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = hf_model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("cache", CACHE_KINDS)
def test_generate_equals_manual_greedy_over_hf(tiny_model, hf_checkpoint, cache):
    expected = manual_greedy(hf_checkpoint.hf_model, PROMPT, 9)
    assert generate(tiny_model, PROMPT, 9, cache=cache).token_ids == expected


@pytest.mark.parametrize("cache", CACHE_KINDS)
def test_eos_stops_generation(tiny_model, cache):
    free = generate(tiny_model, PROMPT, 10, cache=cache).token_ids
    eos = free[3]
    first = free.index(eos)  # the first time eos appears (may be before index 3)
    stopped = generate(tiny_model, PROMPT, 10, cache=cache, eos_token_id=eos, max_model_len=20)
    assert stopped.token_ids == free[:first + 1]
    if cache == "contiguous":
        assert stopped.cache.seq_lens == [len(PROMPT) + len(stopped.token_ids) - 1]


@pytest.mark.parametrize("cache", CACHE_KINDS)
def test_any_of_several_stop_tokens_ends_generation(tiny_model, cache):
    """An instruct model stops at EOS or at its end-of-turn token: whichever comes first."""
    free = generate(tiny_model, PROMPT, 10, cache=cache).token_ids
    stops = [free[6], free[3]]
    first = min(free.index(t) for t in stops)
    stopped = generate(tiny_model, PROMPT, 10, cache=cache, eos_token_id=stops)
    assert stopped.token_ids == free[:first + 1]
    assert generate(tiny_model, PROMPT, 10, cache=cache, eos_token_id=[]).token_ids == free


def test_a_bad_stop_token_is_named(tiny_model):
    with pytest.raises(ValueError, match=r"eos_token_id must be an integer in \[0, 127\], got 128"):
        generate(tiny_model, PROMPT, 2, eos_token_id=[3, 128])


def test_several_prompts_on_the_paged_cache_are_one_batch(tiny_model):
    """The paged engine batches several prompts with no prefix cache: each gets the tokens it
    gets alone."""
    prompts = [PROMPT, [5, 6], PROMPT + [7]]
    batch = generate(tiny_model, prompts, 6, cache="paged", block_size=4)
    assert batch.prefix_stats is None
    assert batch.prompt_completions == [[generate(tiny_model, p, 6).token_ids] for p in prompts]
    with pytest.raises(ValueError, match="needs cache='paged' or 'prefix'"):
        generate(tiny_model, prompts, 6, cache="contiguous")


def test_max_new_tokens_is_respected_and_ids_are_ints(tiny_model):
    for n in (1, 2, 7):
        result = generate(tiny_model, PROMPT, n, cache="contiguous", max_model_len=16)
        assert len(result.token_ids) == n
        assert all(type(t) is int and 0 <= t < 128 for t in result.token_ids)
        assert result.cache.max_model_len == 16


def test_default_max_model_len_is_max_position_embeddings(tiny_model):
    limit = tiny_model.config.max_position_embeddings  # 64
    result = generate(tiny_model, [1], 1, cache="contiguous")
    assert result.cache.max_model_len == limit
    assert result.cache.reserved_bytes == 2 * 2 * limit * 2 * 8 * 4
    with pytest.raises(ValueError, match=f"max_model_len={limit}"):
        generate(tiny_model, [1] * (limit - 2), 3, cache="none")


def test_unknown_cache_kind(tiny_model):
    with pytest.raises(ValueError, match="'slab'.*none, contiguous, paged"):
        generate(tiny_model, PROMPT, 2, cache="slab")


@pytest.mark.parametrize("prompt, new, limit, vocab, fragment", [
    ([], 3, 10, 100, "empty"),
    ([1, 2], 0, 10, 100, "max_new_tokens must be a positive integer, got 0"),
    ([1, 2], -4, 10, 100, "got -4"),
    ([1, 100, 2], 3, 10, 100, "[100]"),
    ([1, -1], 3, 10, 100, "[-1]"),
    ([1, 2.5], 3, 10, 100, "[2.5]"),
    ([1, True], 3, 10, 100, "[True]"),
    ([1] * 8, 3, 10, 100, "prompt of 8 tokens + max_new_tokens=3 = 11 tokens > max_model_len=10"),
])
def test_check_request_messages(prompt, new, limit, vocab, fragment):
    with pytest.raises(ValueError) as info:
        check_request(prompt, new, limit, vocab)
    assert fragment in str(info.value)


def test_check_request_accepts_the_boundary():
    check_request([1] * 7, 3, 10, 100)  # exactly max_model_len
    check_request([0, 99], 1, 3, 100)  # the first and last token ids


def test_bad_request_touches_no_memory(tiny_model, monkeypatch):
    """Validation happens before any cache is built."""
    import kvlab.generate as generate_module

    def explode(*args, **kwargs):
        raise AssertionError("a cache was built for an invalid request")

    monkeypatch.setattr(generate_module, "ContiguousKVCache", explode)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(tiny_model, [1, 500], 2, cache="contiguous")
