"""kvlab.decode_speed: the work a KV cache saves, counted exactly, and its time measured; a batch
of decode steps timed (the median step), its FLOPs counted, and the matmul peak they are set
against; and notebook 00's batch limits, checked against the caches that admit them."""

from __future__ import annotations

import pytest
import torch

from kvlab.config import PRESETS
from kvlab.contiguous import ContiguousKVCache
from kvlab.decode_speed import (decode_step_flops, matmul_peak, time_batched_decode,
                                time_decoding, tokens_fed)
from kvlab.errors import KVCacheOutOfMemory
from kvlab.generate import generate
from kvlab.gpus import Card
from kvlab.paged import KVCacheManager, cdiv, kv_block_bytes, num_blocks_for_budget
from kvlab.serving.cost_model import CostModel
from kvlab.serving.request import Request
from kvlab.sizing import kv_bytes_per_token


def test_tokens_fed_by_hand():
    # The notebook-01 exercise: 10 prompt tokens, 100 generated.
    assert tokens_fed(10, 100, "none") == 100 * 10 + 99 * 100 // 2 == 5_950
    assert tokens_fed(10, 100, "contiguous") == 10 + 99 == 109
    assert tokens_fed(1, 1, "none") == tokens_fed(1, 1, "contiguous") == 1
    with pytest.raises(ValueError, match="paged"):
        tokens_fed(3, 3, "paged")
    with pytest.raises(ValueError):
        tokens_fed(0, 3, "none")


def test_time_decoding_counts_what_the_model_really_runs(tiny_model):
    fed = []
    handle = tiny_model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    try:
        timings = time_decoding(tiny_model, [3, 1, 4, 1, 5], 12, repeats=2)
    finally:
        handle.remove()
    none, cached = timings["none"], timings["contiguous"]
    assert none.token_ids == cached.token_ids and len(none.token_ids) == 12
    assert (none.tokens_fed, cached.tokens_fed) == (12 * 5 + 66, 5 + 11)
    # Each kind ran 1 + repeats times: the hook saw exactly tokens_fed per run.
    assert sum(fed) == 3 * (none.tokens_fed + cached.tokens_fed)
    assert none.seconds_per_token > 0 and cached.seconds_per_token > 0
    with pytest.raises(ValueError, match="repeats"):
        time_decoding(tiny_model, [1], 2, repeats=0)


# ---- a batch of decode steps: FLOPs counted, time measured, peak measured beside it -----------

@pytest.mark.parametrize("name", ["llama-3.1-8b", "smollm2-135m", "llama-2-7b"])
def test_decode_step_flops_is_the_cost_models_count(name):
    """Tied (SmolLM2) and untied embeddings: the same FLOPs as the serving clock's decode step."""
    config = PRESETS[name]
    model = CostModel(config, Card("any", 80, 1.0, 1.0), dtype="bf16")
    for batch, context in ((1, 0), (7, 100), (256, 4095)):
        # each request computes 1 token after `context` cached ones: c + 1 (query, key) pairs
        _, flops = model.step_work(batch, batch * context, batch * (context + 1), batch)
        assert decode_step_flops(config, batch, context) == flops


def test_decode_step_flops_by_hand(small_config):
    # vocab 64, hidden 32, intermediate 64, 2 layers, 4 q / 2 KV heads of 8, untied:
    # per layer q, o 32x32, k, v 32x16, gate, up, down 32x64, two norms of 32 = 9,280;
    # the LM head 64 x 32 = 2,048 and the final norm 32 (the embedding is a lookup).
    matmul = 2 * 9_280 + 2_048 + 32
    attention = 4 * 2 * 4 * 8 * (10 + 1)
    assert decode_step_flops(small_config, 3, 10) == 3 * (2 * matmul + attention)
    with pytest.raises(ValueError, match="batch"):
        decode_step_flops(small_config, 0, 10)
    with pytest.raises(ValueError, match="context_len"):
        decode_step_flops(small_config, 1, -1)


def test_time_batched_decode_runs_real_greedy_steps(tiny_model):
    """Every request decodes what one greedy request decodes alone (its blocks are the prompt's
    copies), each step feeds one token per request, and the figures are those of a timed step."""
    context_len, steps = 5, 2
    outputs = []
    handle = tiny_model.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        timings = time_batched_decode(tiny_model, [1, 3], context_len=context_len, steps=steps,
                                      block_size=4, seed=7)
    finally:
        handle.remove()
    prompt = torch.randint(tiny_model.config.vocab_size, (context_len,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    alone = generate(tiny_model, prompt, steps + 2, cache="contiguous").token_ids
    for index, batch in enumerate([1, 3]):
        prefill, *decode = outputs[index * (steps + 2):(index + 1) * (steps + 2)]
        assert prefill.shape[0] == 1 and [out.shape[0] for out in decode] == [batch] * (steps + 1)
        picked = [prefill.argmax(-1).tolist()] + [out.argmax(-1).tolist() for out in decode]
        assert picked == [[token] * len(row) for token, row in zip(alone, picked)]
    for timing, batch in zip(timings, [1, 3]):
        assert timing.batch == batch and timing.seconds > 0
        assert timing.context_len in (context_len + 1, context_len + 2)  # a timed step, not warm-up
        assert timing.flops == decode_step_flops(tiny_model.config, batch, timing.context_len)
        assert timing.tokens_per_s == batch / timing.seconds
        assert timing.flops_per_s == timing.flops / timing.seconds


def test_time_batched_decode_keeps_the_median_of_its_timed_steps(tiny_model):
    """Five timed steps by default, the median kept: the step whose time is
    the middle one, with that step's context and FLOPs; an even count keeps the faster middle."""
    for steps, timing in ((5, time_batched_decode(tiny_model, [2], context_len=4)[0]),
                          (4, time_batched_decode(tiny_model, [2], context_len=4, steps=4)[0])):
        assert len(timing.step_seconds) == steps and all(s > 0 for s in timing.step_seconds)
        assert timing.seconds == sorted(timing.step_seconds)[(steps - 1) // 2]
        # step i (1-based) ran after 4 + i tokens: the kept step's context is its own
        assert timing.context_len == 4 + 1 + timing.step_seconds.index(timing.seconds)
        assert timing.flops == decode_step_flops(tiny_model.config, 2, timing.context_len)


def test_the_notebooks_batch_limits_are_what_the_allocators_admit(small_config):
    """Notebook 00, section 6: in a KV budget, the naive limit is whole max_model_len slabs and the
    paged limit whole blocks of each request; the real caches admit exactly that many."""
    per_token = kv_bytes_per_token(small_config, "fp32")  # 2 x 2 x 2 x 8 x 4 = 256 B
    budget, max_model_len, request_len, block_size = 100_000, 128, 40, 16
    naive = budget // (max_model_len * per_token)  # the notebook's arithmetic
    paged = budget // (cdiv(request_len, block_size) * block_size * per_token)
    assert (naive, paged) == (3, 8)

    ContiguousKVCache(small_config, naive, max_model_len, "fp32", "cpu", budget_bytes=budget)
    with pytest.raises(KVCacheOutOfMemory, match="budget"):
        ContiguousKVCache(small_config, naive + 1, max_model_len, "fp32", "cpu",
                          budget_bytes=budget)

    num_blocks = num_blocks_for_budget(budget, 0, kv_block_bytes(small_config, block_size, "fp32"))
    manager = KVCacheManager(num_blocks, block_size)
    admitted = [manager.allocate_slots(Request(i, 0.0, request_len, 1), request_len)
                for i in range(paged + 1)]
    assert all(admitted[:paged]) and admitted[paged] is None


def test_time_batched_decode_rejects_bad_sizes(tiny_model):
    with pytest.raises(ValueError, match="empty"):
        time_batched_decode(tiny_model, [])
    with pytest.raises(ValueError, match="batch size"):
        time_batched_decode(tiny_model, [4, 0])
    with pytest.raises(ValueError, match="steps"):
        time_batched_decode(tiny_model, [1], steps=0)


def test_matmul_peak_times_the_matmul_it_names():
    peak = matmul_peak("cpu", torch.float32, size=64, repeats=2)
    assert (peak.device, peak.dtype, peak.size) == ("cpu", torch.float32, 64)
    assert peak.flops == 2 * 64 ** 3 and peak.seconds > 0
    assert peak.flops_per_s == peak.flops / peak.seconds
    with pytest.raises(ValueError, match="size"):
        matmul_peak("cpu", size=0)
