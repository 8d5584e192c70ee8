"""Every limit checked against the model and each other; every count and index range-checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from kvlab.contiguous import ContiguousKVCache
from kvlab.errors import RequestTooLongError
from kvlab.generate import generate
from kvlab.paged import PagedKVCache
from kvlab.serving import LLMEngine, Request, generate_batch
from kvlab.checks import check_index, check_int, check_model_len, check_request

# ---- B. max_model_len never above max_position_embeddings ---------------------------------------

def test_check_model_len_defaults_to_the_model_and_refuses_more(small_config):
    assert check_model_len(small_config, None) == 128
    assert check_model_len(small_config, 128) == 128
    with pytest.raises(ValueError, match="max_model_len=100,000 > max_position_embeddings=128"):
        check_model_len(small_config, 100_000)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1, got 0"):
        check_model_len(small_config, 0)


@pytest.mark.parametrize("cache", ["none", "contiguous", "paged"])
def test_generate_refuses_a_max_model_len_past_the_model(small_llama, cache, monkeypatch):
    import kvlab.generate as generate_module

    def explode(*args, **kwargs):
        raise AssertionError("a cache was built for a refused max_model_len")

    monkeypatch.setattr(generate_module, "ContiguousKVCache", explode)
    monkeypatch.setattr(generate_module, "generate_batch", explode)
    with pytest.raises(ValueError, match="max_model_len=129 > max_position_embeddings=128"):
        generate(small_llama, [1, 2], 2, cache=cache, max_model_len=129)


def test_llm_engine_and_generate_batch_refuse_it_too(small_llama):
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        LLMEngine(small_llama, num_blocks=64, block_size=4, max_model_len=256)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        generate_batch(small_llama, [[1, 2]], 2, max_model_len=256)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        PagedKVCache.for_model(small_llama, num_blocks=64, block_size=4, max_model_len=256)


def test_other_limits_of_the_engine(small_llama):
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        LLMEngine(small_llama, num_blocks=8, block_size=4, max_num_seqs=0)
    with pytest.raises(ValueError, match=r"eos_token_id must be an integer in \[0, 63\], got 64"):
        LLMEngine(small_llama, num_blocks=8, block_size=4, eos_token_id=64)
    with pytest.raises(ValueError, match=r"eos_token_id must be an integer in \[0, 63\], got -1"):
        generate(small_llama, [1], 2, eos_token_id=-1)
    engine = LLMEngine(small_llama, num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=2)
    with pytest.raises(ValueError,
                       match=r"n \(at most max_num_seqs\) must be an integer in \[1, 2\], got 3"):
        engine.add_request([1, 2], 2, n=3)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got -3"):
        engine.add_request([1, 2], -3)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        LLMEngine(small_llama, num_blocks=8, block_size=0)
    assert not engine.has_unfinished()


def test_one_bad_prompt_does_not_take_down_the_batch(small_llama):
    good = [3, 4, 5]
    result = generate_batch(small_llama, [good, [], [1, 99], list(range(40))], 3, max_model_len=32)
    assert result.token_ids[0] == generate(small_llama, good, 3).token_ids
    assert result.errors[0] is None
    assert "empty" in result.errors[1]
    assert "[99]" in result.errors[2]
    assert "max_model_len=32" in result.errors[3]
    assert result.token_ids[1:] == [[], [], []]


def test_an_overlong_request_is_a_request_too_long_error():
    with pytest.raises(RequestTooLongError, match="= 11 tokens > max_model_len=10"):
        check_request([1] * 8, 3, 10, 100)


# ---- C. the range checks themselves -------------------------------------------------------------

@given(st.integers(-1000, 1000))
def test_check_index_accepts_exactly_0_to_size_minus_1(value):
    if 0 <= value < 7:
        assert check_index("slot", value, 7) == value
    else:
        with pytest.raises(ValueError, match=rf"slot must be an integer in \[0, 6\], got {value}"):
            check_index("slot", value, 7)


@pytest.mark.parametrize("value", [1.0, True, "1", None, [1]])
def test_check_int_refuses_non_integers(value):
    with pytest.raises(ValueError, match="must be an integer"):
        check_int("count", value)


def test_check_int_accepts_numpy_and_torch_integers():
    assert check_int("count", np.int64(3)) == 3
    assert check_int("count", torch.tensor(4)) == 4


# ---- C. the contiguous cache: positions, slabs, layers ----------------------------------------

def contiguous_state(cache):
    return cache.k.clone(), cache.v.clone(), list(cache.seq_lens), list(cache.in_use)


def same_state(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:]


@given(first=st.integers(-8, 12), count=st.integers(1, 4), gap=st.integers(0, 3))
def test_contiguous_refuses_negative_positions_and_gaps_and_changes_nothing(small_config, first,
                                                                          count, gap):
    cache = ContiguousKVCache(small_config, max_num_seqs=2, max_model_len=12)
    slab = cache.add_sequence()
    cache.seq_lens[slab] = 3  # as if a 3-token prompt had been written
    positions = torch.tensor([first] + [first + gap + i for i in range(1, count)])
    shape = (count, small_config.num_key_value_heads, small_config.head_dim)
    query = torch.zeros(count, small_config.num_attention_heads, small_config.head_dim)
    valid = 0 <= first <= 3 and (gap == 0 or count == 1) and first + count <= 12
    before = contiguous_state(cache)
    store = cache.view(slab)
    if valid:
        store.attend(0, query, torch.ones(shape), torch.ones(shape), positions)
        return
    with pytest.raises((ValueError, MemoryError), match="position"):
        store.attend(0, query, torch.ones(shape), torch.ones(shape), positions)
    assert same_state(contiguous_state(cache), before)


@pytest.mark.parametrize("slab", [-1, 2, 1.0])
def test_contiguous_slab_ids_are_range_checked(small_config, slab):
    cache = ContiguousKVCache(small_config, max_num_seqs=2, max_model_len=4)
    cache.add_sequence()
    cache.add_sequence()
    before = contiguous_state(cache)
    for call in (cache.view, cache.free_sequence):
        with pytest.raises(ValueError, match=rf"slab must be an integer in \[0, 1\], got {slab}"):
            call(slab)
    assert same_state(contiguous_state(cache), before)


def test_contiguous_double_free_and_bad_layer_are_refused(small_config):
    cache = ContiguousKVCache(small_config, max_num_seqs=1, max_model_len=4)
    slab = cache.add_sequence()
    store = cache.view(slab)
    shape = (1, small_config.num_key_value_heads, small_config.head_dim)
    with pytest.raises(ValueError, match=r"layer_index must be an integer in \[0, 1\], got -1"):
        store.attend(-1, torch.zeros(1, 4, 8), torch.ones(shape), torch.ones(shape),
                     torch.tensor([0]))
    cache.free_sequence(slab)
    with pytest.raises(ValueError, match="slab 0 is not in use"):
        cache.free_sequence(slab)


# ---- C. the paged cache's own public calls ------------------------------------------------------

def test_paged_cache_checks_block_ids_layers_and_batches(small_config):
    cache = PagedKVCache(small_config, num_blocks=4, block_size=4)
    a = Request("a", 0.0, 3, 1)
    cache.manager.allocate_slots(a, 3)
    with pytest.raises(ValueError, match=r"dst block_id must be an integer in \[0, 3\], got -1"):
        cache.copy_block(0, -1)
    with pytest.raises(ValueError, match=r"layer_index must be an integer in \[0, 1\], got 2"):
        cache.gather("a", 2)
    with pytest.raises(KeyError, match="unknown request 'b'"):
        cache.gather("b", 0)
    with pytest.raises(ValueError, match="at least one seq_id"):
        cache.block_tables_tensor([])
    with pytest.raises(ValueError, match="num_new_tokens must be an integer >= 0, got -10"):
        cache.manager.allocate_slots(a, -10)
    with pytest.raises(ValueError, match=r"query_len of sequence 'a' must be an integer in "
                                         r"\[1, 3\], got 4"):
        cache.batch_store(["a"], [4])
    with pytest.raises(ValueError, match="2 query_lens for 1 sequences"):
        cache.batch_store(["a"], [1, 2])
    store = cache.batch_store(["a"], [3])
    assert store.slot_mapping.tolist() == [0, 1, 2]
    kv = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match=r"layer_index must be an integer in \[0, 1\], got -1"):
        store.attend(-1, torch.zeros(3, 4, 8), kv, kv, torch.arange(3))
    assert cache.manager.num_tokens("a") == 3 and cache.manager.num_free_blocks == 3


# ---- C. the torch attention path refuses ids and lengths a kernel would trust ------------------

def test_torch_attention_range_checks():
    from kvlab.paged import gather_kv, paged_decode_attention, paged_prefill_attention, write_kv

    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    kv = torch.ones(1, 2, 8)
    for slot in (-1, 12):
        with pytest.raises(ValueError, match=rf"slot_mapping must be in \[0, 11\], got {slot}"):
            write_kv(k_cache, v_cache, kv, kv, torch.tensor([slot]))
    assert k_cache.abs().sum() == 0  # nothing written
    with pytest.raises(ValueError, match=r"block_table must be in \[0, 2\], got -1"):
        gather_kv(k_cache, torch.tensor([0, -1]), 5)
    with pytest.raises(ValueError, match=r"seq_len must be in \[0, 8\], got 9"):
        gather_kv(k_cache, torch.tensor([0, 1]), 9)
    query = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, 8\], got 0"):
        paged_decode_attention(query, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, 8\], got 9"):
        paged_decode_attention(query, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([9]))
    for wrong in ([5], [3]):  # one query token of a 5-token sequence is at position 4
        with pytest.raises(ValueError, match=rf"query_positions must be the sequence's last 1, "
                                             rf"4 \.\. 4, got \[{wrong[0]}\]"):
            paged_prefill_attention(query, k_cache, v_cache, torch.tensor([0, 1]), 5,
                                    torch.tensor(wrong))
    with pytest.raises(ValueError, match="3 query heads cannot be grouped over 2 KV heads"):
        paged_prefill_attention(torch.zeros(1, 3, 8), k_cache, v_cache, torch.tensor([0, 1]), 5,
                                torch.tensor([4]))
    with pytest.raises(ValueError, match="head_dim mismatch"):
        paged_prefill_attention(torch.zeros(1, 4, 6), k_cache, v_cache, torch.tensor([0, 1]), 5,
                                torch.tensor([4]))
