"""Test oracles: independent answers the course's own code is checked against.

Used only by tests and checks (`tests/`, `kvlab check`, notebook cells that prove an equivalence),
never by the caches or the model. An oracle is written a different way from the code it checks,
so that one mistake cannot hide in both: here attention goes through PyTorch's fused
`scaled_dot_product_attention` (SDPA) over explicitly repeated K/V heads, where the course's
`kvlab.attention.grouped_attention` groups query heads and never repeats K/V.

Compare with `kvlab.paged.torch_attention`, which is *teaching code*: the stage-4 paged attention a
learner reads, and the implementation the stage-5 kernel is checked against.
"""

from __future__ import annotations

import torch

from .attention import repeat_kv

__all__ = ["sdpa_attention"]


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   query_positions: torch.Tensor) -> torch.Tensor:
    """Oracle: causal attention of one sequence by PyTorch SDPA over repeated K/V heads.

    Args:
        query: [num_query_tokens, num_attention_heads, head_dim].
        key, value: [num_key_tokens, num_key_value_heads, head_dim]; keys at positions
            0 .. num_key_tokens - 1.
        query_positions: [num_query_tokens] int64; a query at position p sees keys at <= p.

    Returns:
        [num_query_tokens, num_attention_heads, head_dim], computed in the input dtype: pass
        float64 tensors for a high-precision answer.
    """
    group = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)
    k = repeat_kv(key, group).transpose(0, 1)
    v = repeat_kv(value, group).transpose(0, 1)
    mask = torch.arange(key.shape[0], device=key.device)[None, :] <= query_positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(0, 1)
