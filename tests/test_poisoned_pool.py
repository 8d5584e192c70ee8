"""Slots a sequence does not own never reach its output, even when they hold NaN or Inf.

A finished request may leave NaN/Inf in its blocks (an fp16 overflow), and fresh memory from
`torch.empty` holds anything. Masking a slot's *score* is not enough: softmax gives it weight 0,
and 0 x NaN = NaN in the weighted sum of values. Every attention path is run here over a pool (or
slab) poisoned everywhere except the slots the sequence wrote, and must give the finite answer of
attention over the written tokens alone (float64 SDPA oracle).

Every backend registered in `kvlab.paged.backends.BACKENDS` is held to this (stage 5's Triton
kernel included, once it registers itself).
"""

from __future__ import annotations

import pytest
import torch

from kvlab.contiguous import ContiguousKVCache
from kvlab.generate import generate
from kvlab.oracles import sdpa_attention
from kvlab.paged import BACKENDS, PagedKVCache, resolve_backend
from kvlab.serving import LLMEngine

# The small case: a pool of 6 blocks x 4 tokens, 4 query / 2 KV heads, head_dim 8.
NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 6, 4, 4, 2, 8
SCALE = HEAD_DIM ** -0.5
POISONS = [float("nan"), float("inf"), float("-inf")]
# Every registered backend, on CPU tensors. Triton runs them in its interpreter, which
# tests/conftest.py turns on only where there is no GPU; on a GPU machine the Triton kernels' own
# poisoned-pool tests (tests/test_triton_paged_attention.py) run on the device instead.
BACKEND_NAMES = [pytest.param(name, marks=pytest.mark.skipif(
                     name == "triton" and torch.cuda.is_available(),
                     reason="CPU tensors need Triton's interpreter (no GPU)"))
                 for name in sorted(BACKENDS)]


def poisoned_pool(poison, dtype=torch.float32):
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.full(shape, poison, dtype=dtype), torch.full(shape, poison, dtype=dtype)


def write_sequence(backend, k_cache, v_cache, block_table, seq_len, seed):
    """Write seq_len random tokens through the backend into the blocks of block_table."""
    generator = torch.Generator().manual_seed(seed)
    key = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=generator).to(k_cache.dtype)
    value = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=generator).to(k_cache.dtype)
    slots = torch.tensor([block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(seq_len)])
    backend.write_kv(k_cache, v_cache, key, value, slots)
    return key, value


def oracle(query, key, value, positions):
    return sdpa_attention(query.double(), key.double(), value.double(), positions)


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
@pytest.mark.parametrize("poison", POISONS)
def test_decode_over_a_block_whose_unused_slots_are_poisoned(backend_name, poison):
    backend = resolve_backend(backend_name)
    k_cache, v_cache = poisoned_pool(poison)
    key, value = write_sequence(backend, k_cache, v_cache, [0], 2, seed=0)  # slots 0-1 of block 0
    query = torch.randn(1, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))

    out = backend.decode(query, k_cache, v_cache, torch.tensor([[0]]), torch.tensor([2]), SCALE)

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), oracle(query, key, value, torch.tensor([1])),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
@pytest.mark.parametrize("poison", POISONS)
def test_decode_batch_padded_with_a_poisoned_block(backend_name, poison):
    backend = resolve_backend(backend_name)
    k_cache, v_cache = poisoned_pool(poison)
    # Sequence 0: 6 tokens in blocks [3, 5]; sequence 1: 2 tokens in block 2, its table padded
    # with block 0 (the pool's padding convention), which is all poison.
    tables, seq_lens = [[3, 5], [2]], [6, 2]
    written = [write_sequence(backend, k_cache, v_cache, t, n, seed=i)
               for i, (t, n) in enumerate(zip(tables, seq_lens))]
    block_tables = torch.tensor([[3, 5], [2, PagedKVCache.PAD_BLOCK_ID]])
    query = torch.randn(2, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))

    out = backend.decode(query, k_cache, v_cache, block_tables, torch.tensor(seq_lens), SCALE)

    assert torch.isfinite(out).all()
    for i, (key, value) in enumerate(written):
        expected = oracle(query[i:i + 1], key, value, torch.tensor([seq_lens[i] - 1]))
        torch.testing.assert_close(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_a_poisoned_pool(backend_name, dtype):
    backend = resolve_backend(backend_name)
    k_cache, v_cache = poisoned_pool(float("nan"), dtype)
    table, seq_len = [4, 1], 5  # the last block holds 1 token and 3 NaN slots
    key, value = write_sequence(backend, k_cache, v_cache, table, seq_len, seed=3)
    positions = torch.arange(seq_len)
    query = torch.randn(seq_len, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    query = query.to(dtype)

    out = backend.prefill(query, k_cache, v_cache, torch.tensor(table), seq_len, positions, SCALE)

    assert torch.isfinite(out).all() and out.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), oracle(query, key, value, positions), **tolerance)


# ---- whole generation: a model over a poisoned cache gives the no-cache tokens ----------------

@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_paged_engine_over_a_poisoned_pool_matches_no_cache(small_llama, backend_name):
    prompts = [[5, 9, 3, 7, 1, 2], [8, 4], [11, 12, 13, 14, 15]]  # ragged: padded decode batches
    engine = LLMEngine(small_llama, num_blocks=16, block_size=4, max_model_len=32,
                         attention_backend=backend_name)
    for k_cache, v_cache in zip(engine.cache.k_caches, engine.cache.v_caches):
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    ids = [engine.add_request(prompt, 6) for prompt in prompts]
    engine.run()
    for prompt, request_id in zip(prompts, ids):
        expected = generate(small_llama, prompt, 6, cache="none").token_ids
        assert engine.outputs(request_id)[0] == expected


def test_contiguous_slab_reused_after_a_poisoned_request_matches_no_cache(small_config,
                                                                         small_llama):
    cache = ContiguousKVCache(small_config, max_num_seqs=1, max_model_len=16)
    cache.k.fill_(float("nan"))  # what a previous request's fp16 overflow could have left
    cache.v.fill_(float("nan"))
    prompt = [5, 9, 3, 7]
    store = cache.view(cache.add_sequence())
    with torch.no_grad():
        logits = small_llama(torch.tensor(prompt), torch.arange(4), store)
        logits = torch.cat([logits, small_llama(torch.tensor([2]), torch.tensor([4]), store)])
        expected = small_llama(torch.tensor(prompt + [2]))
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
