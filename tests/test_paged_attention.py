"""Reference paged attention equals contiguous attention, and a float64 SDPA reference, on ragged
sequences scattered over shuffled (non-contiguous) blocks, with padded block tables."""

from __future__ import annotations

import pytest
import torch

from kvlab.attention import grouped_attention
from kvlab.oracles import sdpa_attention
from kvlab.paged import gather_kv, paged_decode_attention, paged_prefill_attention, write_kv

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def scatter_sequences(seq_lens, block_size, num_blocks, seed):
    """Random contiguous K/V per sequence, written into a shuffled set of blocks.

    Returns the pool tensors, each sequence's block table (list) and its contiguous K/V.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    # Fill the pool with garbage first: padding and unused blocks must never leak into a result.
    k_cache, v_cache = 100 * torch.randn(shape, generator=generator), torch.randn(shape,
                                                                                  generator=generator)
    free_ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables, contiguous = [], []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        table, free_ids = free_ids[:count], free_ids[count:]
        key = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=generator)
        value = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=generator)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(seq_len)])
        write_kv(k_cache, v_cache, key, value, slots)
        tables.append(table)
        contiguous.append((key, value))
    return k_cache, v_cache, tables, contiguous


CASES = [  # (seq_lens, block_size)
    ([1, 4, 5, 11, 16, 3], 4),
    ([7, 1, 2], 1),
    ([33, 16, 17, 1], 16),
]


@pytest.mark.parametrize("seq_lens, block_size", CASES)
def test_gather_returns_each_sequence_in_position_order(seq_lens, block_size):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache, tables, contiguous = scatter_sequences(seq_lens, block_size, num_blocks, 0)
    for table, seq_len, (key, value) in zip(tables, seq_lens, contiguous):
        assert torch.equal(gather_kv(k_cache, torch.tensor(table), seq_len), key)
        assert torch.equal(gather_kv(v_cache, torch.tensor(table), seq_len), value)


@pytest.mark.parametrize("seq_lens, block_size", CASES)
def test_decode_attention_matches_contiguous_and_float64_reference(seq_lens, block_size):
    num_blocks = sum(-(-n // block_size) for n in seq_lens)  # every block used, block 0 too,
    k_cache, v_cache, tables, contiguous = scatter_sequences(seq_lens, block_size, num_blocks, 1)
    assert 0 in sum(tables, [])  # so padding entries (block 0) point at another sequence's data
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens_t = torch.tensor(seq_lens)
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))

    out = paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens_t)

    assert out.shape == query.shape and out.dtype == query.dtype
    for i, (key, value) in enumerate(contiguous):
        position = torch.tensor([seq_lens[i] - 1])
        expected = grouped_attention(query[i:i + 1], key, value, query_positions=position)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-5, atol=1e-6)
        exact = sdpa_attention(query[i:i + 1].double(), key.double(), value.double(), position)
        torch.testing.assert_close(out[i:i + 1].double(), exact, rtol=1e-5, atol=1e-6)


def test_one_decode_gather_serves_every_layer_of_a_pass():
    # Its gather buffers are refilled by each layer: layer B's call must not see layer A's K/V,
    # and a pool of another dtype (or one autograd tracks) gets a fresh copy instead.
    from kvlab.paged.torch_attention import decode_attention, decode_gather

    seq_lens, block_size = [5, 9, 1], 4
    layers = [scatter_sequences(seq_lens, block_size, 8, seed)[:3] for seed in (5, 6)]
    width = max(len(table) for table in layers[0][2])
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    outputs = []
    for k_cache, v_cache, tables in layers:
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        outputs.append(paged_decode_attention(query, k_cache, v_cache, block_tables,
                                              torch.tensor(seq_lens)))
    gather = decode_gather(torch.tensor([t + [0] * (width - len(t)) for t in layers[0][2]]),
                           torch.tensor(seq_lens), layers[0][0])
    assert not torch.equal(outputs[0], outputs[1])
    for _ in range(2):  # A, A again after the buffers were filled
        torch.testing.assert_close(decode_attention(query, *layers[0][:2], gather), outputs[0])
    doubled = [cache.double() for cache in layers[0][:2]]
    torch.testing.assert_close(decode_attention(query.double(), *doubled, gather),
                               outputs[0].double(), rtol=1e-5, atol=1e-6)
    tracked = [cache.clone().requires_grad_() for cache in layers[0][:2]]
    out = decode_attention(query, *tracked, gather)
    torch.testing.assert_close(out, outputs[0])
    assert out.requires_grad
    # Autograd keeps each layer's K/V for the backward pass: a later layer must not overwrite them.
    tracked_query = query.clone().requires_grad_()
    total = sum(decode_attention(tracked_query, *layer[:2], gather).sum() for layer in layers)
    total.backward()
    assert torch.isfinite(tracked_query.grad).all()
    # A gather made in inference mode (as `generate` runs) serves a later pass outside it.
    with torch.inference_mode():
        inference_gather = decode_gather(gather.rows.new_tensor(
            [t + [0] * (width - len(t)) for t in layers[0][2]]), torch.tensor(seq_lens),
            layers[0][0])
    with torch.no_grad():
        torch.testing.assert_close(decode_attention(query, *layers[0][:2], inference_gather),
                                   outputs[0])


def test_decode_padding_is_masked_by_seq_lens_not_by_block_id():
    # One sequence of 1 token in block 3, padded with block 0, which holds huge values.
    k_cache, v_cache = torch.zeros(4, 2, KV_HEADS, HEAD_DIM), torch.zeros(4, 2, KV_HEADS, HEAD_DIM)
    k_cache[0], v_cache[0] = 1e4, 1e4
    v_cache[3, 0] = 1.0
    query = torch.ones(2, HEADS, HEAD_DIM)
    block_tables = torch.tensor([[3, 0], [0, 3]])
    out = paged_decode_attention(query, k_cache, v_cache, block_tables, torch.tensor([1, 3]))
    assert torch.allclose(out[0], torch.ones(HEADS, HEAD_DIM))  # only its own token


@pytest.mark.parametrize("seq_lens, block_size", CASES)
def test_prefill_attention_matches_contiguous_and_float64_reference(seq_lens, block_size):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache, tables, contiguous = scatter_sequences(seq_lens, block_size, num_blocks, 3)
    generator = torch.Generator().manual_seed(4)
    for table, seq_len, (key, value) in zip(tables, seq_lens, contiguous):
        for num_queries in {seq_len, max(1, seq_len // 2)}:  # whole prompt, or only its tail
            positions = torch.arange(seq_len - num_queries, seq_len)
            query = torch.randn(num_queries, HEADS, HEAD_DIM, generator=generator)
            out = paged_prefill_attention(query, k_cache, v_cache, torch.tensor(table), seq_len,
                                          positions)
            expected = grouped_attention(query, key, value, query_positions=positions)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            exact = sdpa_attention(query.double(), key.double(), value.double(), positions)
            torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)


def test_write_kv_writes_only_the_mapped_slots():
    k_cache, v_cache = torch.zeros(3, 2, KV_HEADS, HEAD_DIM), torch.zeros(3, 2, KV_HEADS, HEAD_DIM)
    key = torch.ones(2, KV_HEADS, HEAD_DIM)
    write_kv(k_cache, v_cache, key, 2 * key, torch.tensor([5, 0]))  # block 2 offset 1, block 0 offset 0
    assert k_cache[2, 1].eq(1).all() and v_cache[0, 0].eq(2).all()
    assert k_cache.sum() == 2 * KV_HEADS * HEAD_DIM


def test_the_prefill_runs_on_sdpas_fused_cpu_kernel():
    # torch_attention's docstring: torch 2.13's CPU flash kernel takes grouped heads and a mask,
    # so the prefill never falls back to the math path that builds the scores. Forced to flash
    # only, a whole sequence (causal) and a later part (masked) both run.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip(f"checked on torch 2.13; this is {torch.__version__}")
    k_cache, v_cache = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    block_table = torch.tensor([2, 0, 3])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for num_tokens in (20, 6):
            query = torch.randn(num_tokens, 6, 16)
            out = paged_prefill_attention(query, k_cache, v_cache, block_table, 20,
                                          torch.arange(20 - num_tokens, 20))
            assert out.shape == query.shape and torch.isfinite(out).all()
