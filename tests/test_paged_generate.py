"""Paged generation equals contiguous / no-cache generation token for token: ragged batches, block
boundaries, block_size 1, preemption, parallel sampling with copy-on-write, rejected requests."""

from __future__ import annotations

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.generate import generate
from kvlab.model import LlamaForCausalLM
from kvlab.paged import KVCacheOutOfMemory, PagedKVCache, RequestTooLongError
from kvlab.serving import LLMEngine, Request, generate_batch

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=128, name="tiny")
NEW = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def make_prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def reference(model, prompts, new=NEW, cache="contiguous", eos_token_id=None):
    return [generate(model, prompt, new, cache=cache, max_model_len=64,
                     eos_token_id=eos_token_id).token_ids for prompt in prompts]


# Lengths = 0 and 1 (mod 4) and others, so prefill and decode cross block boundaries everywhere.
RAGGED = [3, 8, 9, 1, 13, 4]


def test_ragged_batch_equals_contiguous_and_no_cache(model):
    prompts = make_prompts(RAGGED)
    result = generate_batch(model, prompts, NEW, block_size=4)
    assert result.token_ids == reference(model, prompts)
    assert result.token_ids == reference(model, prompts, cache="none")
    assert result.errors == [None] * len(prompts)
    assert result.stats.num_preemptions == 0
    assert result.cache.manager.num_free_blocks == result.cache.num_blocks  # all freed at the end


def test_block_size_one_and_per_request_max_new_tokens(model):
    prompts = make_prompts([1, 2, 5])
    new = [3, 9, 1]
    result = generate_batch(model, prompts, new, block_size=1)
    expected = [generate(model, p, n).token_ids for p, n in zip(prompts, new)]
    assert result.token_ids == expected
    assert [len(t) for t in result.token_ids] == new


def test_preemption_by_recompute_gives_the_same_tokens(model):
    prompts = make_prompts(RAGGED)
    # max_model_len 24 needs 6 blocks of 4: the smallest pool vLLM would start with.
    result = generate_batch(model, prompts, NEW, block_size=4, num_blocks=6, max_model_len=24)
    assert result.stats.num_preemptions > 0
    assert result.stats.num_recomputed_tokens > 0
    assert result.stats.peak_blocks_in_use <= 6
    assert result.token_ids == reference(model, prompts)


def test_waste_stays_under_one_block_per_sequence_at_every_step(model):
    engine = LLMEngine(model, num_blocks=8, block_size=4, max_model_len=24)
    for prompt in make_prompts(RAGGED):
        engine.add_request(prompt, NEW)
    cache = engine.cache
    while engine.has_unfinished():
        engine.step()
        empty_slots = (cache.reserved_bytes - cache.used_bytes) // cache.bytes_per_token
        assert 0 <= empty_slots <= len(engine.running) * (cache.block_size - 1)
        assert cache.reserved_bytes <= cache.pool_bytes == 8 * cache.block_bytes
    assert engine.stats.num_preemptions > 0
    assert cache.reserved_bytes == cache.used_bytes == 0


def test_parallel_sampling_shares_the_prompt(model):
    prompts = make_prompts([6, 8])  # 6 % 4 != 0: the shared last block is copied on write
    result = generate_batch(model, prompts, NEW, block_size=4, n=4)
    expected = reference(model, prompts)
    assert result.completions == [[tokens] * 4 for tokens in expected]  # greedy siblings agree
    # blocks_saved_by_sharing = block-table entries - physical blocks, at its largest: at the
    # fork, 4 siblings x (2 + 2) prompt blocks in tables over 2 + 2 blocks stored.
    assert result.stats.blocks_saved_by_sharing == 4 * (2 + 2) - (2 + 2)
    assert result.stats.num_cow_copies == 3  # only the 6-token prompt's partial block, 3 siblings


def test_blocks_saved_by_sharing_is_table_entries_minus_blocks_at_its_largest(model):
    engine = LLMEngine(model, num_blocks=16, block_size=4, max_model_len=24)
    engine.add_request(make_prompts([6])[0], NEW, n=3)
    saved = []
    while engine.has_unfinished():
        engine.step()
        saved.append(engine.kv.num_logical_blocks - engine.kv.num_used_blocks)
    # Right after the fork: 3 tables list the prompt's 2 blocks (6 entries) held once. Later a
    # copy-on-write adds a block and no entry, a block past the prompt one of each: no larger.
    assert saved[0] == 3 * 2 - 2
    assert engine.stats.blocks_saved_by_sharing == max(saved) == 3 * 2 - 2


def test_forced_first_tokens_make_siblings_diverge_without_seeing_each_other(model):
    prompt = make_prompts([6])[0]
    first = [5, 17, 40]
    result = generate_batch(model, [prompt], NEW, block_size=4, n=3, first_tokens=[first])
    assert result.stats.num_cow_copies == 2
    for token, completion in zip(first, result.completions[0]):
        # Each sibling must continue exactly as if it had been alone with prompt + its token.
        assert completion == [token] + generate(model, prompt + [token], NEW - 1).token_ids


def test_forks_survive_preemption(model):
    prompts = make_prompts([6, 5])
    first = [[5, 17, 40], [1, 2, 3]]
    result = generate_batch(model, prompts, NEW, block_size=4, n=3, first_tokens=first,
                            num_blocks=4, max_model_len=16)
    assert result.stats.num_preemptions > 0
    for prompt, tokens, completions in zip(prompts, first, result.completions):
        for token, completion in zip(tokens, completions):
            assert completion == [token] + generate(model, prompt + [token], NEW - 1).token_ids


def test_sampling_is_seeded_per_sequence_and_unchanged_by_preemption(model):
    prompts = make_prompts([6, 3])
    kwargs = dict(block_size=4, n=3, temperature=1.0, seed=7)
    roomy = generate_batch(model, prompts, NEW, **kwargs)
    tight = generate_batch(model, prompts, NEW, num_blocks=4, max_model_len=16, **kwargs)
    assert tight.stats.num_preemptions > 0
    assert roomy.completions == tight.completions
    assert len({tuple(c) for c in roomy.completions[0]}) > 1  # siblings diverged


def test_eos_stops_a_sequence_early(model):
    prompts = make_prompts(RAGGED)
    eos = reference(model, prompts)[0][2]
    result = generate_batch(model, prompts, NEW, block_size=4, eos_token_id=eos)
    assert result.token_ids == reference(model, prompts, eos_token_id=eos)
    assert result.token_ids[0][-1] == eos and len(result.token_ids[0]) == 3


def test_too_long_request_is_rejected_and_the_others_finish(model):
    prompts = make_prompts([5, 20, 9])
    result = generate_batch(model, prompts, NEW, block_size=4, num_blocks=6)  # max_model_len 24
    assert result.errors[0] is None and result.errors[2] is None
    message = result.errors[1]
    assert "20 prompt tokens + max_new_tokens=8 = 28 tokens" in message
    assert "max_model_len=24" in message and "6 blocks = 24 tokens" in message
    assert result.token_ids[1] == []
    assert [result.token_ids[0], result.token_ids[2]] == reference(model, [prompts[0], prompts[2]])


def test_engine_rejects_at_add_request(model):
    engine = LLMEngine(model, num_blocks=6, block_size=4, max_model_len=24)
    with pytest.raises(RequestTooLongError, match="= 25 tokens .* > max_model_len=24"):
        engine.add_request(list(range(20)), 5)
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], 5)
    with pytest.raises(ValueError, match="first_tokens has 1 ids for n=2"):
        engine.add_request([1, 2], 3, n=2, first_tokens=[4])


def test_start_up_refuses_a_pool_smaller_than_one_max_model_len_request(model):
    with pytest.raises(KVCacheOutOfMemory, match="max_model_len=40 request needs 10 blocks"):
        generate_batch(model, make_prompts([3]), 4, block_size=4, num_blocks=6, max_model_len=40)


def test_step_by_step_api_drives_the_model(model):
    """The notebook flow: allocate, prefill, append, decode a batch, fork, free."""
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    manager = cache.manager
    prompts = make_prompts([5, 3])
    requests = [Request(seq_id, 0.0, len(p), 4, p) for seq_id, p in enumerate(prompts)]
    last = []
    for request, prompt in zip(requests, prompts):
        manager.allocate_slots(request, len(prompt))
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)),
                       cache.batch_store([request.request_id], [len(prompt)]))
        last.append(int(logits[-1].argmax()))
    for request in requests:
        manager.allocate_slots(request, 1)
    store = cache.batch_store([0, 1], [1, 1])
    assert store.slot_mapping.tolist() == [1 * 4 + 1, 2 * 4 + 3]  # positions 5 and 3
    logits = model(torch.tensor(last), torch.tensor([5, 3]), store)
    for seq_id, prompt in enumerate(prompts):
        expected = model(torch.tensor(prompt + [last[seq_id]]))[-1]
        torch.testing.assert_close(logits[seq_id], expected, rtol=1e-4, atol=1e-5)
    copy = Request("copy", 0.0, 5, 4)
    manager.fork(requests[0], copy)
    assert "'copy'" in cache.format_block_tables()
    for request in (*requests, copy):
        manager.free(request)
    assert cache.manager.num_free_blocks == 8


def test_peak_without_sharing_is_what_separate_requests_would_hold(model):
    prompts = make_prompts([6, 8])
    shared = generate_batch(model, prompts, NEW, block_size=4, n=4)
    # The same 8 sequences run as 8 separate requests (no fork, nothing shared): their peak.
    alone = generate_batch(model, [p for p in prompts for _ in range(4)], NEW, block_size=4)
    assert shared.stats.peak_blocks_unshared == alone.stats.peak_blocks_in_use
    assert alone.stats.peak_blocks_unshared == alone.stats.peak_blocks_in_use
    assert shared.stats.peak_blocks_in_use < alone.stats.peak_blocks_in_use
