"""kvlab.contiguous: the naive slab cache gives the no-cache tokens and counts its bytes exactly."""

from __future__ import annotations

import pytest
import torch

import kvlab.contiguous as contiguous
from kvlab.config import PRESETS, LlamaConfig
from kvlab.contiguous import ContiguousKVCache, KVCacheOutOfMemory, reservation_bytes
from kvlab.generate import generate
from kvlab.memory import tensor_bytes


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- equivalence with no cache ---------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [1, 2, 5, 17])
def test_contiguous_generation_equals_no_cache(tiny_model, prompt_len):
    prompt = prompt_of(prompt_len, seed=prompt_len)
    plain = generate(tiny_model, prompt, 10, cache="none", max_model_len=40)
    cached = generate(tiny_model, prompt, 10, cache="contiguous", max_model_len=40)
    assert plain.cache is None
    assert cached.token_ids == plain.token_ids
    assert len(cached.token_ids) == 10
    assert all(isinstance(t, int) for t in cached.token_ids)


def test_decode_feeds_one_token_at_the_position_after_the_last(tiny_model, monkeypatch):
    """Instrument the slab's KV store: prefill positions 0..P-1, then P, P+1, ... one at a time."""
    calls: list[tuple[int, list[int], int]] = []
    original = contiguous.ContiguousSequence.attend

    def spy(self, layer_index, query, key, value, positions):
        calls.append((layer_index, positions.tolist(), query.shape[0]))
        return original(self, layer_index, query, key, value, positions)

    monkeypatch.setattr(contiguous.ContiguousSequence, "attend", spy)
    prompt, new = prompt_of(4), 5
    generate(tiny_model, prompt, new, cache="contiguous", max_model_len=16)
    layers = tiny_model.config.num_hidden_layers
    layer0 = [(positions, n) for layer, positions, n in calls if layer == 0]
    assert len(calls) == layers * new  # one forward per generated token
    assert layer0[0] == ([0, 1, 2, 3], 4)  # prefill
    assert layer0[1:] == [([p], 1) for p in range(4, 4 + new - 1)]  # decode


def test_cache_contents_after_generation(tiny_model, hf_checkpoint):
    """seq_len = prompt + generated - 1 (the last token is never fed back); slab rows past it are
    still zero; rows before it hold exactly HF's (post-RoPE) keys and values."""
    prompt, new = prompt_of(6, seed=3), 7
    result = generate(tiny_model, prompt, new, cache="contiguous", max_model_len=20)
    cache = result.cache
    held = len(prompt) + new - 1
    assert cache.seq_lens == [held]
    assert cache.in_use == [True]
    assert torch.count_nonzero(cache.k[:, :, held:]) == 0
    assert torch.count_nonzero(cache.v[:, :, held:]) == 0
    assert bool((cache.k[:, 0, :held].abs().sum(-1) > 0).all())

    # The same keys/values from HF's own cache over the same held tokens.
    tokens = torch.tensor([prompt + result.token_ids[:-1]])
    with torch.no_grad():
        out = hf_checkpoint.hf_model(tokens, use_cache=True)
    hf_cache = out.get("cache") or out.get("past_key_values")
    for layer in range(tiny_model.config.num_hidden_layers):
        if hasattr(hf_cache, "layers"):
            hf_k, hf_v = hf_cache.layers[layer].keys, hf_cache.layers[layer].values
        else:
            hf_k, hf_v = hf_cache.key_cache[layer], hf_cache.value_cache[layer]
        # HF: [batch, kv_heads, tokens, head_dim]; kvlab slab: [tokens, kv_heads, head_dim].
        torch.testing.assert_close(cache.k[layer, 0, :held], hf_k[0].transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v[layer, 0, :held], hf_v[0].transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)


def test_two_requests_interleaved_in_one_cache(tiny_model):
    """Decode steps of two requests alternate over two slabs; each gets its no-cache tokens."""
    config = tiny_model.config
    cache = ContiguousKVCache(config, max_num_seqs=3, max_model_len=24)
    prompts = [prompt_of(3, seed=10), prompt_of(7, seed=11)]
    expected = [generate(tiny_model, p, 6, cache="none").token_ids for p in prompts]
    slabs = [cache.add_sequence(), cache.add_sequence()]
    assert slabs == [0, 1]
    inputs = [torch.tensor(p) for p in prompts]
    positions = [torch.arange(len(p)) for p in prompts]
    got: list[list[int]] = [[], []]
    with torch.no_grad():
        for _ in range(6):
            for i, slab in enumerate(slabs):
                token = tiny_model(inputs[i], positions[i], cache.view(slab))[-1].argmax()
                got[i].append(int(token))
                inputs[i], positions[i] = token.view(1), positions[i][-1:] + 1
    assert got == expected
    assert cache.seq_lens == [3 + 5, 7 + 5, 0]
    assert torch.count_nonzero(cache.k[:, 2]) == 0  # the third slab was never touched


# ---- accounting ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, element", [(torch.float32, 4), (torch.float16, 2),
                                            (torch.bfloat16, 2)])
def test_reserved_bytes_are_the_exact_tensor_bytes(tiny_model, dtype, element):
    config = tiny_model.config  # 2 layers, 2 KV heads, head_dim 8
    cache = ContiguousKVCache(config, max_num_seqs=3, max_model_len=10, dtype=dtype)
    by_hand = 2 * 2 * 3 * 10 * 2 * 8 * element  # K and V x layers x seqs x tokens x heads x dim
    assert cache.reserved_bytes == by_hand
    assert cache.reserved_bytes == tensor_bytes([cache.k, cache.v])
    assert cache.k.dtype == cache.v.dtype == dtype
    assert cache.reserved_bytes == reservation_bytes(config, 3, 10, element)
    assert cache.bytes_per_token == 2 * 2 * 2 * 8 * element
    assert cache.used_bytes == 0
    assert cache.allocator_delta_bytes is None  # CPU: no allocator to ask


def test_used_bytes_follow_tokens_held_and_free_keeps_reservation(tiny_model):
    config = tiny_model.config
    cache = ContiguousKVCache(config, max_num_seqs=2, max_model_len=12)
    per_token = 2 * 2 * 2 * 8 * 4  # 256 B
    a, b = cache.add_sequence(), cache.add_sequence()
    with torch.no_grad():
        tiny_model(torch.tensor(prompt_of(5)), torch.arange(5), cache.view(a))
        tiny_model(torch.tensor(prompt_of(3)), torch.arange(3), cache.view(b))
    assert cache.seq_lens == [5, 3]
    assert cache.used_bytes == 8 * per_token == 2048
    reserved = cache.reserved_bytes
    assert reserved == 2 * 12 * per_token
    cache.free_sequence(a)
    assert cache.used_bytes == 3 * per_token
    assert cache.reserved_bytes == reserved  # freeing gives no bytes back: the point of the design
    assert cache.add_sequence() == a  # the freed slab is reused
    assert cache.seq_lens[a] == 0


def test_start_up_over_budget_names_the_formula():
    config = PRESETS["llama-3.1-8b"]  # 128 KiB per token in bf16
    with pytest.raises(KVCacheOutOfMemory) as info:
        ContiguousKVCache(config, max_num_seqs=128, max_model_len=4096, dtype=torch.bfloat16,
                          budget_bytes=40 * 2**30)
    message = str(info.value)
    # 128 x 4096 x 131,072 B = 68,719,476,736 B = 64 GiB > 40 GiB.
    assert 128 * 4096 * 131_072 == 64 * 2**30
    for number in ("128", "4096", "128 KiB", "64 GiB", "40 GiB"):
        assert number in message, number
    assert isinstance(info.value, MemoryError)


def test_budget_exactly_met_is_allowed(tiny_model):
    config = tiny_model.config
    exact = reservation_bytes(config, 2, 4, 4)
    assert ContiguousKVCache(config, 2, 4, budget_bytes=exact).reserved_bytes == exact
    with pytest.raises(KVCacheOutOfMemory):
        ContiguousKVCache(config, 2, 4, budget_bytes=exact - 1)


def test_bad_sizes_rejected(tiny_model):
    with pytest.raises(ValueError, match="max_num_seqs.*0"):
        ContiguousKVCache(tiny_model.config, 0, 8)
    with pytest.raises(ValueError, match="max_model_len.*-1"):
        ContiguousKVCache(tiny_model.config, 1, -1)


# ---- limits leave everything else untouched ---------------------------------------------------

def test_prompt_longer_than_max_model_len_is_a_value_error_with_numbers(tiny_model):
    with pytest.raises(ValueError) as info:
        generate(tiny_model, prompt_of(10), 1, cache="contiguous", max_model_len=8)
    message = str(info.value)
    assert "10" in message and "max_model_len=8" in message and "11" in message


def test_overlong_sequence_in_a_slab_leaves_the_cache_untouched(tiny_model):
    config = tiny_model.config
    cache = ContiguousKVCache(config, max_num_seqs=2, max_model_len=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    with torch.no_grad():
        tiny_model(torch.tensor(prompt_of(4, seed=1)), torch.arange(4), cache.view(a))
    k_before, v_before = cache.k.clone(), cache.v.clone()
    lens_before = list(cache.seq_lens)

    with pytest.raises((ValueError, MemoryError)) as info, torch.no_grad():
        tiny_model(torch.tensor(prompt_of(9, seed=2)), torch.arange(9), cache.view(b))
    assert "max_model_len=8" in str(info.value)
    assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before)
    assert cache.seq_lens == lens_before

    # Slab b is still usable, and request a continues as if nothing happened.
    prompt_b = prompt_of(3, seed=5)
    with torch.no_grad():
        logits_b = tiny_model(torch.tensor(prompt_b), torch.arange(3), cache.view(b))
        reference_b = tiny_model(torch.tensor(prompt_b))
        next_a = tiny_model(torch.tensor([7]), torch.tensor([4]), cache.view(a))
        reference_a = tiny_model(torch.tensor(prompt_of(4, seed=1) + [7]))
    torch.testing.assert_close(logits_b, reference_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(next_a[-1], reference_a[-1], atol=1e-5, rtol=1e-5)
    assert cache.seq_lens == [5, 3]


def test_add_sequence_beyond_max_num_seqs_changes_nothing(tiny_model):
    cache = ContiguousKVCache(tiny_model.config, max_num_seqs=2, max_model_len=6)
    cache.add_sequence()
    cache.add_sequence()
    with torch.no_grad():
        tiny_model(torch.tensor([1, 2]), torch.arange(2), cache.view(1))
    state = (list(cache.in_use), list(cache.seq_lens), cache.k.clone(), cache.reserved_bytes,
             cache.used_bytes)
    with pytest.raises(KVCacheOutOfMemory, match="2"):
        cache.add_sequence()
    assert cache.in_use == state[0] and cache.seq_lens == state[1]
    assert torch.equal(cache.k, state[2])
    assert (cache.reserved_bytes, cache.used_bytes) == state[3:]


def test_view_of_a_free_slab_is_refused(tiny_model):
    cache = ContiguousKVCache(tiny_model.config, max_num_seqs=2, max_model_len=6)
    with pytest.raises(ValueError, match="slab 1"):
        cache.view(1)


def test_reservation_formula_for_a_real_shape():
    config = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=10, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    # 16 seqs x 1024 tokens x (2 x 4 x 2 x 8 x 2 B = 256 B) = 4 MiB.
    assert reservation_bytes(config, 16, 1024, 2) == 16 * 1024 * 256 == 4 * 2**20
