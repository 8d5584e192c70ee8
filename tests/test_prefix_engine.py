"""Stage 6 in the engine: prefix caching on vs off gives the same greedy tokens (ragged batch,
whole-block hits, a prompt cached entirely, hits followed by decode, hits after preemption, forks),
while the cache skips prefill tokens; salts isolate."""

from __future__ import annotations

import pytest
import torch

from kvlab.generate import generate
from kvlab.serving import LLMEngine, generate_batch


def prefix_batch(*args, **kwargs):
    """generate_batch with stage 6's prefix cache on."""
    return generate_batch(*args, enable_prefix_caching=True, **kwargs)


@pytest.fixture
def model(small_llama):  # tests/conftest.py's random GQA model (4 query / 2 KV heads, head_dim 8)
    return small_llama


def shared_prompts(shared_len, tail_lengths, seed=5):
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 64, (shared_len,), generator=generator).tolist()
    return [shared + torch.randint(0, 64, (n,), generator=generator).tolist()
            for n in tail_lengths]


def no_cache(model, prompts, new):
    return [generate(model, prompt, new, cache="none").token_ids for prompt in prompts]


def test_ragged_batch_with_shared_prefixes_matches_no_cache_and_paged(model):
    prompts = shared_prompts(10, [0, 3, 6, 1, 2])  # 10 tokens: 2 full blocks of 4 shared
    prompts.append(prompts[0][:8])                  # a prompt cached entirely (2 blocks)
    result = prefix_batch(model, prompts, 6, block_size=4)
    assert result.token_ids == no_cache(model, prompts, 6)
    assert result.token_ids == generate_batch(model, prompts, 6, block_size=4).token_ids
    stats = result.prefix_stats
    # Prompts 1-4 hit both shared blocks; the fully cached one hits block 0 only (the n - 1 cap).
    assert stats.num_hit_tokens == 4 * 8 + 4
    assert result.stats.num_prefill_tokens == sum(map(len, prompts)) - stats.num_hit_tokens
    assert result.cache.manager.num_free_blocks == result.cache.num_blocks


def test_a_hit_leaving_one_prompt_token_still_prefills_it(model):
    # 17 tokens in blocks of 16: the second copy hits block 0 and runs its last prompt token as
    # a decode row of the step's one pass; that token is prefill work all the same.
    [prompt] = shared_prompts(17, [0])
    result = prefix_batch(model, [prompt, prompt], 4, block_size=16)
    assert result.prefix_stats.num_hit_tokens == 16
    assert result.stats.num_prefill_tokens == 17 + 1
    assert result.token_ids == no_cache(model, [prompt, prompt], 4)


def test_hits_on_blocks_filled_during_decode(model):
    [prompt] = shared_prompts(5, [0])
    engine = LLMEngine(model, num_blocks=16, block_size=4, max_model_len=64,
                       enable_prefix_caching=True)
    first = engine.add_request(prompt, 8)
    engine.run()
    follow_up = prompt + engine.outputs(first)[0] + [7, 8]  # the chat's next turn
    second = engine.add_request(follow_up, 5)
    engine.run()
    assert engine.outputs(second)[0] == no_cache(model, [follow_up], 5)[0]
    assert engine.prefix_stats.num_hit_tokens == 12  # 5 + 7 tokens written: 3 full blocks


def test_preempted_requests_hit_their_own_blocks_and_tokens_stay_the_same(model):
    prompts = shared_prompts(6, [3, 5, 2, 7])
    small = dict(block_size=4, num_blocks=10, max_model_len=40)
    cached = prefix_batch(model, prompts, 12, **small)
    paged = generate_batch(model, prompts, 12, **small)
    assert cached.stats.num_preemptions > 0 and paged.stats.num_preemptions > 0
    assert cached.token_ids == paged.token_ids == no_cache(model, prompts, 12)
    assert cached.stats.num_prefill_tokens < paged.stats.num_prefill_tokens


def test_forks_share_hit_blocks_and_copy_on_write_still_works(model):
    prompts = shared_prompts(9, [2, 3])
    engines = [LLMEngine(model, 32, 4, enable_prefix_caching=True), LLMEngine(model, 32, 4)]
    outputs = []
    for engine in engines:
        ids = [engine.add_request(prompt, 5, n=2, first_tokens=[1, 2]) for prompt in prompts]
        engine.run()
        outputs.append([engine.outputs(rid) for rid in ids])
    assert outputs[0] == outputs[1]
    assert engines[0].stats.num_cow_copies == engines[1].stats.num_cow_copies > 0
    assert engines[0].prefix_stats.num_hit_tokens == 8


def test_salts_isolate_tenants_in_the_engine(model):
    prompt = shared_prompts(12, [1])[0]
    result = prefix_batch(model, [prompt] * 3, 3, block_size=4, cache_salts=["a", "b", "a"])
    assert result.prefix_stats.num_hit_tokens == 12  # only the third (tenant a again) hits
    assert result.token_ids[0] == result.token_ids[1] == result.token_ids[2]
    bad = prefix_batch(model, [prompt], 3, block_size=4, cache_salts=[5])
    assert bad.errors[0] and "cache_salt must be a string" in bad.errors[0]


@pytest.mark.parametrize("layout", ["token-major", "head-major"])
def test_prefix_hits_with_the_triton_backend(model, layout, triton_on_cpu):
    from kvlab.paged import resolve_backend

    prompts = shared_prompts(9, [2, 5, 0])
    runs = {name: prefix_batch(model, prompts, 5, block_size=4,
                               attention_backend=resolve_backend(name, layout))
            for name in ("torch", "triton")}
    assert runs["triton"].token_ids == runs["torch"].token_ids == no_cache(model, prompts, 5)
    assert runs["triton"].prefix_stats.num_hit_tokens == 8 + 8  # 9 shared tokens: 2 blocks


def test_generate_entry_point_owns_the_prefix_cache(model):
    # One entry point (issue 6): generate(cache="prefix") takes several prompts, gives each the
    # tokens cache="paged" gives it alone, and reports the prefix cache's hits.
    prompts = shared_prompts(9, [2, 5, 3])  # 9 shared tokens: 2 full blocks of 4
    result = generate(model, prompts, 5, cache="prefix", block_size=4)
    for prompt, completions in zip(prompts, result.prompt_completions):
        assert completions == [generate(model, prompt, 5, cache="paged", block_size=4).token_ids]
    assert result.token_ids == result.prompt_completions[0][0]
    assert result.prefix_stats.num_hit_tokens == 2 * 8      # prompts 1 and 2 hit both blocks
    assert result.prefix_stats.hit_rate == 16 / sum(map(len, prompts))
    assert result.stats.num_prefill_tokens == sum(map(len, prompts)) - 16
    one = generate(model, prompts[0], 5, cache="prefix", block_size=4)  # one prompt: no hits
    assert one.token_ids == result.token_ids and one.prefix_stats.num_hit_tokens == 0


def test_several_prompts_need_a_paged_cache(model):
    prompts = shared_prompts(4, [1, 2])
    with pytest.raises(ValueError, match="2 prompts given.*cache='paged' or 'prefix'"):
        generate(model, prompts, 3, cache="contiguous")
    with pytest.raises(ValueError, match="token id"):
        generate(model, [prompts[0], [999]], 3, cache="prefix")
