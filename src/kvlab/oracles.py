"""Test oracles: independent answers the course's own code is checked against.

Used by tests, `kvlab check` and notebook cells, never by the caches or the model. An oracle is
written another way, so one mistake cannot hide in both: PyTorch's SDPA over repeated K/V heads,
where `kvlab.attention.grouped_attention` groups query heads. (`kvlab.paged.torch_attention` is
teaching code, the stage-4 paged attention the stage-5 kernel is checked against.)
"""

from __future__ import annotations

import torch

from .attention import repeat_kv

__all__ = ["sdpa_attention"]


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   query_positions: torch.Tensor) -> torch.Tensor:
    """Causal attention as `grouped_attention` (keys at 0 .. num_key_tokens - 1), in the input
    dtype: pass float64 for a high-precision answer."""
    group = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)
    k = repeat_kv(key, group).transpose(0, 1)
    v = repeat_kv(value, group).transpose(0, 1)
    mask = torch.arange(key.shape[0], device=key.device)[None, :] <= query_positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(0, 1)
