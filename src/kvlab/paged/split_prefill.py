"""A chunk's attention split into parts over disjoint keys, merged by their log-sum-exps.

Attention over keys A and B is the two attentions over A and over B, each weighed by its share of
the total exp-sum: the split-KV reduction of stage 5b (flash-decoding, Dao et al. 2023; vLLM's
PagedAttention v2 partitions). The CPU torch backend uses it twice:

* a later prefill chunk (`earlier_then_own`): every query sees all earlier keys, so they need no
  mask and are read in place, piece by piece; the chunk's own keys are the plain causal case. A
  [T, seq_len] mask costs PyTorch's CPU flash kernel about 20 % of its time at 4,000 keys, the
  split a few small merges (docs/vllm_comparison.md, section 9);
* a decode batch over a shared prefix (`torch_attention`'s cascade): the prefix once for the whole
  batch, each sequence's own blocks apart, merged (Hydragen, Juravsky et al. 2024, section 3).

Pieces are (keys, values) pairs of pool rows, [n, num_key_value_heads, head_dim] each, consecutive
from position 0, in `torch_attention`.
"""

from __future__ import annotations

import torch

# A later chunk is split into earlier keys and its own only from this many earlier tokens: below
# it, two calls and a merge cost what the mask saves (one CPU thread, SmolLM2's shapes, a
# 256-token chunk alone: 0.9x at 256 earlier keys, equal at 768, 1.6x faster at 1,792, 1.4x at
# 3,744; the six long prompts through the engine, splitting from 1 or from 1,024: within 3 %).
SPLIT_MIN_EARLIER = 512

# PyTorch's CPU flash-attention kernel, the one SDPA calls on the CPU, called directly because it
# also returns each row's log-sum-exp of scores (`earlier_then_own`). Absent: the masked SDPA.
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def earlier_then_own(q: torch.Tensor, earlier: list[tuple[torch.Tensor, torch.Tensor]],
                     own_k: torch.Tensor, own_v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of a chunk of T queries as its unmasked part over the earlier keys (one
    or more pieces, each [1, H_kv, n, D]) and its causal part over its own T keys ([1, H_kv, T,
    D]), merged. For the earlier keys, the G query heads of each KV head are stacked into one head
    of G * T rows: the same keys, fewer and larger matrix products. q [1, H, T, D] float32 ->
    [1, H, T, D]."""
    _, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = own_k.shape[1]
    stacked = q.reshape(1, num_kv_heads, num_heads // num_kv_heads * num_tokens, head_dim)
    merged = None
    for k, v in earlier:
        part = CPU_FLASH(stacked, k, v, scale=scale)
        merged = part if merged is None else merge_attention(*merged, *part)
    own = CPU_FLASH(q, own_k, own_v, is_causal=True, scale=scale)
    out, _ = merge_attention(merged[0].reshape(q.shape), merged[1].reshape(own[1].shape), *own)
    return out


def merge_attention(first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor,
                    second_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys merged into attention over their union, and its
    log-sum-exp. Each output is softmax-weighted within its own keys, so it weighs its share of
    the whole exp-sum: the second's share is e^b / (e^a + e^b) = sigmoid(b - a) for log-sum-exps
    a, b (shaped as the outputs without their last dim)."""
    share = torch.sigmoid(second_lse - first_lse).unsqueeze(-1)
    return torch.lerp(first, second, share), torch.logaddexp(first_lse, second_lse)
