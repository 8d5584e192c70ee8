"""The decode kernel on a pool of more than 2^31 elements, with a sequence in its last blocks (GPU).

A block's first element sits at block_id x (block_size x num_kv_heads x head_dim); in int32 that
product wraps once one layer's pool holds 2^31 elements, and the kernel would read some other
block without any error. The kernel widens block ids to int64 before multiplying
(`kernels/paged_attention.py`); no CPU test can reach that size in Triton's interpreter, so this
one runs where there is a GPU: 140,000 blocks x 16 tokens x 8 KV heads x 128 dims of fp16 (2.29e9
elements, 4.6 GB each for K and V), every slot NaN but the two sequences' own, one of them in the
last 63 blocks, against float64 attention (`kvlab.oracles`) over the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.kernels.pool_layout import LAYOUTS, TOKEN_MAJOR, pool_shape
from kvlab.oracles import sdpa_attention

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, GROUP = 140_000, 16, 8, 128, 4
SEQ_LENS = [1000, 37]  # the first in the pool's last blocks, the second in its first ones
POOL_BYTES = 2 * NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2  # K and V, fp16


def test_the_pool_passes_int32():
    assert NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM > 2 ** 31
    first_of_last = (NUM_BLOCKS - 1) * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    assert first_of_last > 2 ** 31  # where the last block starts, in elements


def big_case(layout: str):
    """(query, k_cache, v_cache, block_tables, seq_lens, keys, values): pools on the GPU, NaN
    but in the sequences' blocks; keys/values [seq_len, Hkv, D] per sequence on the CPU."""
    gen = torch.Generator().manual_seed(31)
    shape = pool_shape(layout, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    v_cache = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    last = -(-SEQ_LENS[0] // BLOCK_SIZE)
    tables = [NUM_BLOCKS - 1 - torch.randperm(last, generator=gen),  # the last blocks, shuffled
              torch.randperm(-(-SEQ_LENS[1] // BLOCK_SIZE), generator=gen)]
    keys, values = [], []
    for table, seq_len in zip(tables, SEQ_LENS):
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).half()
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).half()
        positions = torch.arange(seq_len)
        blocks, slots = table[positions // BLOCK_SIZE].cuda(), (positions % BLOCK_SIZE).cuda()
        if layout == TOKEN_MAJOR:
            k_cache[blocks, slots], v_cache[blocks, slots] = k.cuda(), v.cuda()
        else:
            k_cache[blocks, :, slots], v_cache[blocks, :, slots] = k.cuda(), v.cuda()
        keys.append(k)
        values.append(v)
    width = max(len(table) for table in tables)
    padded = [torch.cat([t, t.new_zeros(width - len(t))]) for t in tables]
    block_tables = torch.stack(padded).to(torch.int32).cuda()
    query = torch.randn(len(SEQ_LENS), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).half()
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32).cuda()
    return query, k_cache, v_cache, block_tables, seq_lens, keys, values


@pytest.mark.cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_pool_past_int32_matches_reference(layout):
    from kvlab.kernels.paged_attention import paged_attention_decode

    free, _ = torch.cuda.mem_get_info()
    if free < POOL_BYTES * 1.1:
        pytest.skip(f"needs {POOL_BYTES / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} free")
    query, k_cache, v_cache, block_tables, seq_lens, keys, values = big_case(layout)
    expected = torch.stack([
        sdpa_attention(query[i:i + 1].double(), keys[i].double(), values[i].double(),
                       query_positions=torch.tensor([SEQ_LENS[i] - 1]))[0]
        for i in range(len(SEQ_LENS))])
    try:
        for num_splits in (None, 1, 4):
            out = paged_attention_decode(query.cuda(), k_cache, v_cache, block_tables, seq_lens,
                                         layout=layout, num_splits=num_splits).cpu()
            assert not out.isnan().any(), (f"{layout}, splits {num_splits}: NaN in the output "
                                           "(a block past 2^31 elements read from elsewhere)")
            error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
            assert error <= 2e-3, f"{layout}, splits {num_splits}: relative error {error:.2e}"
    finally:
        del k_cache, v_cache
        torch.cuda.empty_cache()
