"""kvlab.attention: grouped-query attention against float64 references that copy K/V per head."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvlab.attention import grouped_attention, repeat_kv
from kvlab.oracles import sdpa_attention

# (query heads, KV heads): MHA, GQA with groups of 2, 3 (not a power of two), 4, 6, MQA.
HEAD_LAYOUTS = [(4, 4), (4, 2), (6, 2), (12, 4), (8, 2), (12, 2), (5, 1), (8, 1)]


def explicit_attention(query, key, value, query_positions, key_positions=None, key_mask=None):
    """The definition, one query head at a time, in float64: head h reads KV head h // G."""
    num_queries, num_heads, head_dim = query.shape
    num_keys, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    if key_positions is None:
        key_positions = torch.arange(num_keys)
    q, k, v = query.double(), key.double(), value.double()
    out = torch.zeros(num_queries, num_heads, head_dim, dtype=torch.float64)
    for h in range(num_heads):
        kv = h // group
        for t in range(num_queries):
            visible = key_positions <= query_positions[t]
            if key_mask is not None:
                visible = visible & key_mask
            scores = (k[visible, kv] @ q[t, h]) / math.sqrt(head_dim)
            out[t, h] = torch.softmax(scores, dim=0) @ v[visible, kv]
    return out


def random_qkv(num_queries, num_keys, num_heads, num_kv_heads, head_dim=8, seed=0,
               dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, num_heads, head_dim, generator=generator, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(num_keys, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
def test_prefill_equals_float64_sdpa_over_repeated_kv(num_heads, num_kv_heads):
    q, k, v = random_qkv(7, 7, num_heads, num_kv_heads, seed=num_heads * 10 + num_kv_heads)
    positions = torch.arange(7)
    got = grouped_attention(q, k, v, positions)
    assert got.shape == q.shape and got.dtype == torch.float32
    # Reference 1: SDPA in float64 with K/V copied per query head and an explicit causal mask.
    group = num_heads // num_kv_heads
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    sdpa = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(got.double(), sdpa, atol=1e-5, rtol=1e-5)
    # Reference 2: the per-head loop.
    torch.testing.assert_close(got.double(), explicit_attention(q, k, v, positions),
                               atol=1e-5, rtol=1e-5)
    # kvlab's own reference (used by other tests) agrees with both.
    torch.testing.assert_close(sdpa_attention(q.double(), k.double(), v.double(), positions),
                               sdpa, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("num_heads, num_kv_heads", HEAD_LAYOUTS)
def test_decode_step_with_offset_positions(num_heads, num_kv_heads):
    """One new token at position 9 over 10 cached keys; then a chunk of 3 at positions 7..9."""
    q, k, v = random_qkv(3, 10, num_heads, num_kv_heads, seed=num_heads + 100 * num_kv_heads)
    decode = grouped_attention(q[:1], k, v, torch.tensor([9]))
    torch.testing.assert_close(decode.double(),
                               explicit_attention(q[:1], k, v, torch.tensor([9])),
                               atol=1e-5, rtol=1e-5)
    chunk_positions = torch.tensor([7, 8, 9])
    chunk = grouped_attention(q, k, v, chunk_positions)
    expected = sdpa_attention(q.double(), k.double(), v.double(), chunk_positions)
    torch.testing.assert_close(chunk.double(), expected, atol=1e-5, rtol=1e-5)
    # Query at position 7 must not see keys 8 and 9: changing them leaves its row unchanged.
    k2, v2 = k.clone(), v.clone()
    k2[8:] += 5.0
    v2[8:] -= 3.0
    torch.testing.assert_close(grouped_attention(q, k2, v2, chunk_positions)[0], chunk[0])
    assert not torch.allclose(grouped_attention(q, k2, v2, chunk_positions)[2], chunk[2])


def test_sdpa_enable_gqa_agrees():
    """Third reference: torch's own GQA path of SDPA (float64)."""
    q, k, v = random_qkv(6, 6, 12, 4, seed=3)
    expected = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1),
        is_causal=True, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(grouped_attention(q, k, v, torch.arange(6)).double(), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (12, 4), (8, 8), (8, 1), (9, 3)])
def test_query_head_h_reads_kv_head_h_div_group(num_heads, num_kv_heads):
    """Every value vector of KV head j is the constant j + 1: each output is its KV head's id."""
    head_dim, num_tokens = 4, 5
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    v = (torch.arange(num_kv_heads, dtype=torch.float32) + 1)[None, :, None].expand(
        num_tokens, num_kv_heads, head_dim).contiguous()
    out = grouped_attention(q, k, v, torch.arange(num_tokens))
    group = num_heads // num_kv_heads
    for h in range(num_heads):
        torch.testing.assert_close(out[:, h], torch.full((num_tokens, head_dim), h // group + 1.0))


def test_kv_head_mapping_with_one_hot_values():
    """Keys pick one token per KV head; query head h must return the token its KV head picked."""
    num_heads, num_kv_heads, head_dim, num_tokens = 6, 2, 4, 4
    group = num_heads // num_kv_heads
    # Values: token t of KV head j holds the one-hot vector of (j + t) % head_dim.
    v = torch.zeros(num_tokens, num_kv_heads, head_dim)
    for t in range(num_tokens):
        for j in range(num_kv_heads):
            v[t, j, (j + t) % head_dim] = 1.0
    # Keys: KV head 0 strongly prefers token 1, KV head 1 token 3 (via a shared query direction).
    k = torch.zeros(num_tokens, num_kv_heads, head_dim)
    k[1, 0, 0] = 100.0
    k[3, 1, 0] = 100.0
    q = torch.zeros(1, num_heads, head_dim)
    q[0, :, 0] = 1.0
    out = grouped_attention(q, k, v, torch.tensor([3]))[0]
    for h in range(num_heads):
        kv = h // group
        chosen = 1 if kv == 0 else 3
        expected = torch.zeros(head_dim)
        expected[(kv + chosen) % head_dim] = 1.0
        torch.testing.assert_close(out[h], expected, atol=1e-6, rtol=0)


def test_key_positions_and_key_mask():
    q, k, v = random_qkv(2, 6, 6, 2, seed=7)
    key_positions = torch.tensor([0, 1, 2, 3, 4, 5])
    key_mask = torch.tensor([True, False, True, True, False, True])  # slots 1 and 4 hold nothing
    query_positions = torch.tensor([4, 5])
    got = grouped_attention(q, k, v, query_positions, key_positions=key_positions,
                            key_mask=key_mask)
    expected = explicit_attention(q, k, v, query_positions, key_positions, key_mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # Same as dropping the masked keys (positions carried along).
    keep = key_mask.nonzero().flatten()
    dropped = grouped_attention(q, k[keep], v[keep], query_positions, key_positions=keep)
    torch.testing.assert_close(got, dropped, atol=1e-6, rtol=1e-6)


def test_low_precision_input_keeps_dtype_and_is_close():
    q, k, v = random_qkv(5, 5, 8, 2, seed=11)
    got = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.arange(5))
    assert got.dtype == torch.bfloat16
    expected = explicit_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.arange(5))
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


def test_does_not_copy_or_modify_inputs():
    q, k, v = random_qkv(4, 4, 6, 2, seed=5)
    before = [t.clone() for t in (q, k, v)]
    grouped_attention(q, k, v, torch.arange(4))
    for t, b in zip((q, k, v), before):
        assert torch.equal(t, b)


def test_repeat_kv_layout():
    kv = torch.arange(2 * 3 * 1, dtype=torch.float32).view(2, 3, 1)  # [T=2, Hkv=3, D=1]
    rep = repeat_kv(kv, 2)
    assert rep.shape == (2, 6, 1)
    for h in range(6):
        assert torch.equal(rep[:, h], kv[:, h // 2])


def test_bad_shapes_raise():
    q, k, v = random_qkv(3, 3, 6, 4)
    with pytest.raises(ValueError, match="6 query heads.*4 KV heads"):
        grouped_attention(q, k, v, torch.arange(3))
    q, k, v = random_qkv(3, 3, 4, 2)
    with pytest.raises(ValueError, match="head_dim"):
        grouped_attention(q, k[..., :4], v[..., :4], torch.arange(3))
