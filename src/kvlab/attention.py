"""Causal attention with grouped-query heads, written so the grouping is visible.

Grouped-query attention (GQA; Ainslie et al., 2023, "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints", section 2) lets G = num_attention_heads /
num_key_value_heads query heads share one key/value head: query head h reads KV head h // G (MHA
is G = 1; MQA, Shazeer 2019, one KV head for all). `grouped_attention` lays a KV head's G query
heads side by side as extra rows, so one batched matmul per KV head serves the group without
copying K/V; `repeat_kv` makes the copy (G times the memory) for the tests' reference and the
training script's SDPA.
"""

from __future__ import annotations

import math

import torch

__all__ = ["causal_mask", "grouped_attention", "kv_group_size", "repeat_kv"]


def kv_group_size(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (GQA's group); ValueError when they do not group evenly."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    return num_heads // num_kv_heads


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """bool [num_queries, num_keys]: True where the key's position is at or before the query's."""
    return key_positions[None, :] <= query_positions[:, None]


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      query_positions: torch.Tensor, key_positions: torch.Tensor | None = None,
                      key_mask: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention of one sequence, GQA by grouping. query [num_query_tokens,
    num_attention_heads, head_dim] (and the output); key, value [num_key_tokens,
    num_key_value_heads, head_dim]; positions int64 (key_positions default 0 .. num_key_tokens - 1);
    key_mask [num_key_tokens] bool, False for padding; scale default 1 / sqrt(head_dim) (Vaswani et
    al., 2017). A query at position p sees keys at positions <= p; scores and softmax in float32 (as
    HF and vLLM). Values no query may see are zeroed first: 0 x NaN is NaN, and a reused or padding
    block may hold another request's NaN. ValueError: uneven head groups, unequal head_dims."""
    num_queries, num_heads, head_dim = query.shape
    num_keys, num_kv_heads, key_dim = key.shape
    if key_dim != head_dim or value.shape != key.shape:
        raise ValueError(f"head_dim mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    group = kv_group_size(num_heads, num_kv_heads)

    # [Tq, Hq, D] -> [Hkv, G * Tq, D]: query head h = kv * G + g lands in block kv, rows g * Tq ...
    grouped_q = query.reshape(num_queries, num_kv_heads, group, head_dim)
    grouped_q = grouped_q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_queries, head_dim)
    keys = key.transpose(0, 1)      # [Hkv, Tk, D], a view
    values = value.transpose(0, 1)  # [Hkv, Tk, D], a view

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scores = torch.bmm(grouped_q.float(), keys.float().transpose(1, 2)) * scale
    scores = scores.view(num_kv_heads, group, num_queries, num_keys)

    if key_positions is None:
        key_positions = torch.arange(num_keys, device=key.device)
    visible = causal_mask(query_positions, key_positions)  # [Tq, Tk]
    if key_mask is not None:
        visible = visible & key_mask[None, :]
    scores = scores.masked_fill(~visible, float("-inf"))

    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * num_queries, num_keys)
    seen = visible.any(dim=0)  # [Tk]: slots at least one query may read
    values = values.float().masked_fill(~seen[None, :, None], 0.0)
    out = torch.bmm(probs, values)  # [Hkv, G * Tq, D]
    out = out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_queries, num_heads, head_dim).to(query.dtype)


def repeat_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * group, D], head h a copy of KV head h // group."""
    return kv.repeat_interleave(group, dim=1)
