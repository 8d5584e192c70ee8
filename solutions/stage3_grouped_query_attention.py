"""Stage 3 exercise: grouped-query attention at decode time, and a second way to convert MHA.

Notebook 03 wrote GQA for one whole sequence (each group of G = num_attention_heads /
num_key_value_heads query heads reads one KV head, without copying K and V) and the MHA -> GQA
conversion by mean-pooling (Ainslie et al., EMNLP 2023, "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints", section 2.1). Two steps further:

* `decode_attention`: the step a server runs most. Each running request brings one new token and
  reads its own contiguous slab of cache (stage 2's layout, num_key_value_heads wide) up to its own
  length; the rest of the slab holds whatever an earlier request left there, NaN included. GQA's
  saving is here: at decode, attention reads the whole cache for one token of compute, so reading
  num_key_value_heads heads instead of num_attention_heads is what makes it faster.
* `pool_kv_heads`: a conversion by *weighted* pooling. New KV head j = sum over p of
  mix[p] x old head j*P + p (P = heads per group). Uniform weights are the paper's mean-pooling;
  a one-hot mix keeps one head of each group, the alternative the paper found worse (section 3.3,
  figure 4). Once `kvlab check 3` passes, measure that in the notebook, after its section 3:

      from kvlab.gqa import convert_to_gqa
      keep_first = lambda w, h, d, n: pool_kv_heads(w, h, d, n, torch.tensor([1.0, 0, 0, 0]))
      model = convert_to_gqa(tiny_mha32, 2, pool=keep_first)

  and its perplexity on `eval_ids` before and after `uptrain(model, train_ids, 30, 8, 128)`, next
  to mean-pooling's. Does the paper's ranking hold? Which head of a group would you keep?

`kvlab check 3` compares `decode_attention` with PyTorch's `scaled_dot_product_attention` over
repeated K/V for each request on its own (`kvlab.oracles.sdpa_attention`, in float64), and
`pool_kv_heads` with `kvlab.gqa.mean_pool_kv_heads`, with selecting rows, and with a loop.

Layout, as in the notebook: per-head tensors are [..., num_heads, head_dim]; query head
h = kv * G + g is the g-th head of KV head kv's group (adjacent query heads share a KV head, as in
HF Llama and vLLM).
"""

from __future__ import annotations

import math

import torch


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor:
    """One decode step of grouped-query attention for a batch of requests, each in its own slab.

        out[i, h] = softmax_s( query[i, h] . k_cache[i, s, h // G] / sqrt(head_dim) )
                    @ v_cache[i, s, h // G],   over s < context_lens[i]

    The newest token is already written at slot context_lens[i] - 1, so it sees itself. Slots
    from context_lens[i] on belong to no one: they may hold anything, NaN and inf included, and
    must not change the result (0 x NaN is NaN: masking the scores alone is not enough). Group the
    query heads as the notebook did; do not copy K/V once per query head (no `repeat_kv`,
    `repeat_interleave`, `repeat`, `tile` or `expand` of the cache; `kvlab check 3` watches).
    Compute in the query's dtype (the tests use float64 and float32).

    Args:
        query: [num_seqs, num_attention_heads, head_dim], each request's new token.
        k_cache, v_cache: [num_seqs, max_model_len, num_key_value_heads, head_dim], same dtype.
        context_lens: int64 [num_seqs], tokens each request holds, new one included.

    Returns:
        [num_seqs, num_attention_heads, head_dim], dtype of query.

    Raises:
        ValueError: num_key_value_heads does not divide num_attention_heads, or a context length
            is outside [1, max_model_len] (the message names the numbers).
    """
    # BEGIN SOLUTION hint: view each request's query heads as [num_kv_heads, G, head_dim] and score
    # hint: them against its slab's keys in one einsum; -inf past each request's length; zero the
    # hint: values no one may read (0 x NaN is NaN) before the weighted sum; undo the view
    num_seqs, num_heads, head_dim = query.shape
    max_model_len, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    if bool((context_lens < 1).any()) or bool((context_lens > max_model_len).any()):
        raise ValueError(f"context lengths {context_lens.tolist()} must lie in "
                         f"[1, max_model_len={max_model_len}]")
    held = torch.arange(max_model_len, device=query.device) < context_lens[:, None]  # [B, L]

    per_kv_head = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", per_kv_head, k_cache) / math.sqrt(head_dim)
    scores = scores.masked_fill(~held[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    values = v_cache.masked_fill(~held[:, :, None, None], 0.0)  # a left-over NaN times 0 is NaN
    out = torch.einsum("bkgl,blkd->bkgd", weights, values)
    return out.reshape(num_seqs, num_heads, head_dim)
    # END SOLUTION


def pool_kv_heads(weight: torch.Tensor, num_kv_heads: int, head_dim: int, new_num_kv_heads: int,
                  mix: torch.Tensor) -> torch.Tensor:
    """Convert a k_proj / v_proj weight to fewer KV heads by a weighted sum of each group's heads.

    With P = num_kv_heads // new_num_kv_heads, new head j serves the query heads that old heads
    j*P .. j*P + P - 1 served, and is sum_p mix[p] * old head (j*P + p). mix = [1/P] * P is the
    paper's mean-pooling (`kvlab.gqa.mean_pool_kv_heads`); mix = [1, 0, ..., 0] keeps the first
    head of each group.

    Args:
        weight: [num_kv_heads * head_dim, hidden_size], an nn.Linear weight (rows are output
            channels, head-major: rows j*head_dim .. (j+1)*head_dim - 1 belong to head j).
        num_kv_heads: heads in `weight`.
        head_dim: channels per head.
        new_num_kv_heads: heads after pooling (1 gives MQA).
        mix: [P] weights, any floating dtype (the same for every group).

    Returns:
        [new_num_kv_heads * head_dim, hidden_size], dtype of weight.

    Raises:
        ValueError: new_num_kv_heads < 1 or it does not divide num_kv_heads, or mix does not hold
            P weights (the message names the numbers).
    """
    # BEGIN SOLUTION hint: a head is head_dim consecutive rows; expose the P heads of each group as
    # hint: an axis of a view of the weight (which axis is which matters), weigh them by mix and sum
    if new_num_kv_heads < 1 or num_kv_heads % new_num_kv_heads:
        raise ValueError(f"cannot pool {num_kv_heads} KV heads into {new_num_kv_heads}: the new "
                         f"count must divide the old one")
    per_group = num_kv_heads // new_num_kv_heads
    if tuple(mix.shape) != (per_group,):
        raise ValueError(f"mix has shape {tuple(mix.shape)}; pooling {num_kv_heads} KV heads into "
                         f"{new_num_kv_heads} needs {per_group} weights, one per head of a group")
    hidden_size = weight.shape[1]
    heads = weight.reshape(new_num_kv_heads, per_group, head_dim, hidden_size)
    pooled = torch.einsum("p,jpdh->jdh", mix.to(weight.dtype), heads)
    return pooled.reshape(new_num_kv_heads * head_dim, hidden_size)
    # END SOLUTION
