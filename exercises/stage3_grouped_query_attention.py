# Stage 3 exercise, generated from solutions/stage3_grouped_query_attention.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 3`.

"""Stage 3 exercise: grouped-query attention (GQA), and what it saves in the KV cache.

With GQA (Ainslie et al., EMNLP 2023, "GQA: Training Generalized Multi-Query Transformer Models
from Multi-Head Checkpoints", section 2) the `num_attention_heads` query heads are split into
`num_key_value_heads` groups of G = num_attention_heads / num_key_value_heads heads, and each
group shares one key/value head. Only the KV heads are cached, so the cache is G times smaller
than with multi-head attention (MHA, G = 1). Multi-query attention (MQA; Shazeer, 2019) is the
extreme: one KV head for all query heads. Llama-3.1-8B: 32 query heads, 8 KV heads, G = 4.

You write:

* `kv_head_for_query_head`: which KV head a query head reads (h // G).
* `grouped_attention`: causal attention where each KV head serves its G query heads, computed by
  grouping the query heads, never by copying K and V G times (that copy, `repeat_kv`, is what a
  naive implementation does, and it spends the very memory GQA saves).
* `mean_pool_kv_heads`: turn an MHA checkpoint's K/V projection into a GQA one (paper,
  section 2.1: average the heads of each group).
* `kv_cache_saving`: how many times smaller the KV cache gets.

`kvlab check 3` compares yours with PyTorch's `scaled_dot_product_attention` over repeated K/V
(`kvlab.oracles.sdpa_attention`, in float64), `kvlab.gqa.mean_pool_kv_heads` and
`kvlab.sizing`. Read `src/kvlab/attention.py` and `src/kvlab/gqa.py` afterwards and compare.

Layout, as in stage 1: the tokens of one sequence lie flat along dim 0, so per-head tensors are
[num_tokens, num_heads, head_dim]. Query head h = kv * G + g is the g-th head of KV head kv's
group (adjacent query heads share a KV head, as in HF Llama and vLLM).
"""

from __future__ import annotations

import math

import torch


def kv_head_for_query_head(h: int, num_attention_heads: int, num_key_value_heads: int) -> int:
    """The KV head that query head `h` reads under GQA.

    The group size is G = num_attention_heads // num_key_value_heads; query heads 0 .. G-1 read
    KV head 0, heads G .. 2G-1 read KV head 1, and so on (GQA paper, section 2, figure 2).
    MHA (G = 1) maps h to itself; MQA (one KV head) maps every h to 0.

    Args:
        h: query head index, 0 <= h < num_attention_heads.
        num_attention_heads: query heads per layer (Llama-3.1-8B: 32).
        num_key_value_heads: KV heads per layer (Llama-3.1-8B: 8).

    Returns:
        The KV head index (int), 0 <= result < num_key_value_heads.

    Raises:
        ValueError: num_key_value_heads < 1, or it does not divide num_attention_heads, or h is
            out of range. The message names the numbers, e.g.
            "32 query heads cannot be split into 5 equal groups (one per KV head)".
    """
    raise NotImplementedError("TODO(stage 3): query heads are grouped in order: each run of num_attention_heads / num_key_value_heads consecutive heads shares one KV head; refuse counts that do not divide and heads out of range (ValueError with the numbers)")


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of one sequence, each KV head serving its group of query heads.

        out[t, h] = softmax_s( q[t, h] . k[s, h // G] / sqrt(head_dim) ) @ v[s, h // G],
        over the key positions s <= t (the causal mask)

    Do it without copying K and V G times (no `repeat_kv`, `repeat_interleave`, `repeat`,
    `tile` or `expand` of K/V): reshape the *queries* instead. The G query heads of KV head kv are
    q[:, kv*G : (kv+1)*G]; lay them side by side as extra rows, [Hkv, G * T, D], and one batched
    matmul with that KV head's keys [Hkv, D, T] gives the scores of the whole group.
    (`kvlab check 3` watches for those calls.)

    Compute in q's dtype (the tests use float64 and float32).

    Args:
        q: [num_tokens, num_attention_heads, head_dim], token t at position t.
        k, v: [num_tokens, num_key_value_heads, head_dim], same dtype as q.

    Returns:
        [num_tokens, num_attention_heads, head_dim], dtype of q.

    Raises:
        ValueError: num_key_value_heads does not divide num_attention_heads (message: the numbers).
    """
    raise NotImplementedError("TODO(stage 3): stage 1's causal attention, but one batched matmul per KV head scores its whole group: make the group's query heads extra rows of q (a reshape of q, never a copy of K/V), mask and softmax each (query head, token) row, then undo the reshape")


def mean_pool_kv_heads(weight: torch.Tensor, num_kv_heads: int, head_dim: int,
                       new_num_kv_heads: int) -> torch.Tensor:
    """Convert a k_proj / v_proj weight to fewer KV heads by averaging each group of heads.

    GQA paper, section 2.1: "the projection matrices of each group are mean-pooled". New KV head
    j serves query heads j*G' .. (j+1)*G' - 1, whose old KV heads were j*P .. j*P + P - 1 with
    P = num_kv_heads // new_num_kv_heads, so new head j is the mean of those P adjacent old heads.

    Args:
        weight: [num_kv_heads * head_dim, hidden_size], an nn.Linear weight (rows are output
            channels, head-major: rows j*head_dim .. (j+1)*head_dim - 1 belong to head j).
        num_kv_heads: heads in `weight`.
        head_dim: channels per head.
        new_num_kv_heads: heads after pooling (1 gives MQA).

    Returns:
        [new_num_kv_heads * head_dim, hidden_size], dtype of weight.

    Raises:
        ValueError: new_num_kv_heads < 1 or it does not divide num_kv_heads (message: the numbers).
    """
    raise NotImplementedError("TODO(stage 3): a head is head_dim consecutive rows of the weight; new head j is the mean of the P adjacent old heads it replaces (expose that P axis, then average over it)")


def kv_cache_saving(num_attention_heads: int, num_key_value_heads: int) -> float:
    """How many times smaller the KV cache is with these heads than with MHA (one KV head per
    query head), everything else equal: MHA bytes / GQA bytes.

    Llama-3.1-8B (32 query heads, 8 KV heads): 4.0, the "GQA with 8 KV heads cuts it 4x" of the
    course's story. MHA: 1.0.

    Args:
        num_attention_heads: query heads per layer.
        num_key_value_heads: KV heads per layer.

    Returns:
        The factor, a float >= 1.

    Raises:
        ValueError: num_key_value_heads < 1, or it does not divide num_attention_heads.
    """
    raise NotImplementedError("TODO(stage 3): the cache holds num_key_value_heads heads instead of num_attention_heads; refuse counts that do not group (ValueError)")
