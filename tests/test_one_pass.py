"""Issue 17, section 3: a block is readable from the pass that writes it on, in every order.

The prefix-caching manager caches a block when its slots are reserved, so a request admitted later
in the same step may hit a block whose K/V the step itself writes: a block the first copy of a
prompt prefills (the second copy's one uncached token then reads it), or a block a running
request's decode token fills. That is correct only if a step is one forward pass that, in every
layer, writes all of the step's K/V before any token of that layer attends (vLLM v1's rule).

Every run here starts from a pool (or slabs) full of NaN, what a reused pool may hold, and checks
the tokens against the no-cache reference (`kvlab.model.NoCache`, through `generate`). The model is
the course's trained tiny model on real text: each test first checks that one missing K/V slot
(zeroed, as in a fresh pool) changes its greedy tokens, so the comparison can fail. The small
random models of the other tests did not react, which is how the defect stayed hidden.
"""

from __future__ import annotations

import pytest

from kvlab.checkpoint import load_model, load_tokenizer
from kvlab.generate import generate
from kvlab.serving import (STRATEGIES, LLMEngine, Request, Scheduler, SchedulerConfig,
                           engine_step, model_strategy)

TEXT = ("Once upon a time there was a little girl named Lily. She loved to play in the garden "
        "with her big red ball every day.")
NEW = 8                # tokens generated per request
MAX_MODEL_LEN = 64
BUDGET_TOKENS = 512    # KV memory of every strategy, in tokens


@pytest.fixture(scope="module")
def model():
    """The course's trained tiny model, float32."""
    return load_model("tiny")


@pytest.fixture(scope="module")
def ids():
    """TEXT's token ids."""
    return load_tokenizer("tiny").encode(TEXT).ids


def reference(model, prompt):
    return generate(model, prompt, NEW, cache="none").token_ids


def poison(cache):
    """Fill a paged pool or contiguous slabs with NaN: a slot read before it is written shows."""
    tensors = cache.k_caches + cache.v_caches if hasattr(cache, "k_caches") else [cache.k, cache.v]
    for tensor in tensors:
        tensor.fill_(float("nan"))


def assert_reacts_to_one_missing_slot(model, prompt, block_size):
    """Zeroing the K/V of one prompt slot (every layer) after the prefill changes the greedy
    tokens, for some slot: the first one tried that does ends the search."""
    expected = reference(model, prompt)
    for position in range(len(prompt)):
        engine = LLMEngine(model, num_blocks=BUDGET_TOKENS // block_size, block_size=block_size,
                           max_model_len=MAX_MODEL_LEN)
        engine.add_request(prompt, NEW)
        engine.step()  # the prefill
        slot = engine.cache.manager.tables[0].slot(position)
        for pool in engine.cache.k_caches + engine.cache.v_caches:
            pool.view(-1, *pool.shape[2:])[slot] = 0
        engine.run()
        if engine.outputs(0)[0] != expected:
            return
    pytest.fail(f"no single zeroed slot changes the tokens of {prompt}: the test could not fail")


def run_strategy(strategy, model, arrivals, block_size):
    """Greedy outputs of requests that arrive at given steps ((step, prompt) pairs), over one
    strategy's cache filled with NaN. Returns (outputs in arrival order, the executor)."""
    kv, executor = model_strategy(strategy, model, BUDGET_TOKENS * kv_bytes_per_token(model),
                                  MAX_MODEL_LEN, block_size=block_size)
    poison(executor.cache)
    scheduler = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    requests, step = [], 0
    while len(requests) < len(arrivals) or scheduler.has_unfinished():
        for arrival_step, prompt in arrivals[len(requests):]:
            if arrival_step > step:
                break
            requests.append(Request(len(requests), 0.0, len(prompt), NEW, prompt))
            scheduler.add_request(requests[-1])
        engine_step(scheduler, executor, float(step))
        step += 1
    return [request.output_token_ids for request in requests], executor


def kv_bytes_per_token(model):
    """KV bytes of one token over all layers (K and V)."""
    config = model.config
    return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
            * model.dtype.itemsize)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("prompt_len", [9, 13, 17])
def test_the_same_prompt_twice_in_one_step(model, ids, strategy, block_size, prompt_len):
    # The second copy hits the blocks the first copy prefills in this same step; with
    # prompt_len = k * block_size + 1 only its last prompt token is left to compute.
    prompt = ids[:prompt_len]
    assert_reacts_to_one_missing_slot(model, prompt, block_size)
    outputs, executor = run_strategy(strategy, model, [(0, prompt), (0, prompt)], block_size)
    assert outputs == [reference(model, prompt)] * 2
    hit = (prompt_len - 1) // block_size * block_size if strategy == "prefix" else 0
    if strategy == "prefix":
        assert executor.cache.manager.prefix_stats.num_hit_tokens == hit
    # The counts notebooks plot: every prompt token not hit is prefill, every fed-back output
    # token is decode.
    assert executor.num_prefill_tokens == 2 * prompt_len - hit
    assert executor.num_decode_tokens == 2 * (NEW - 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("block_size, prompt_len", [(4, 7), (16, 15)])
@pytest.mark.parametrize("tail", [1, 3], ids=["tail-in-a-decode-row", "tail-in-a-chunk"])
def test_a_hit_on_the_block_a_decode_token_fills_in_that_step(model, ids, strategy, block_size,
                                                              prompt_len, tail):
    # Step 0 prefills the first request; in step 1 its decode token (its first output) fills its
    # block 1 (block 0 at block size 16), which is cached when that slot is reserved. The second
    # request, admitted in step 1, is that text plus `tail` tokens and hits the block.
    first = ids[:prompt_len]
    second = first + reference(model, first)[:1] + ids[prompt_len:prompt_len + tail]
    assert_reacts_to_one_missing_slot(model, second, block_size)
    outputs, executor = run_strategy(strategy, model, [(0, first), (1, second)], block_size)
    assert outputs == [reference(model, first), reference(model, second)]
    if strategy == "prefix":
        assert executor.cache.manager.prefix_stats.num_hit_tokens == prompt_len + 1


def test_the_same_prompt_twice_with_the_triton_backend(model, ids, triton_on_cpu):
    prompt = ids[:9]
    engine = LLMEngine(model, num_blocks=16, block_size=4, max_model_len=32,
                       attention_backend="triton", enable_prefix_caching=True)
    poison(engine.cache)
    first, second = (engine.add_request(prompt, NEW) for _ in range(2))
    engine.run()
    assert engine.prefix_stats.num_hit_tokens == 8
    assert engine.outputs(first) == engine.outputs(second) == [reference(model, prompt)]
