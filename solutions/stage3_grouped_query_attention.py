"""Stage 3 exercise: grouped-query attention at decode time, and MHA -> GQA with any grouping.

Notebook 03 wrote GQA for one whole sequence (each group of G = num_attention_heads /
num_key_value_heads query heads reads one KV head, without copying K and V) and the MHA -> GQA
conversion that mean-pools *adjacent* heads (Ainslie et al., EMNLP 2023, "GQA: Training
Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", section 2.1). Two steps
further:

* `decode_attention`: the step a server runs most. Each running request brings one new token and
  reads its own contiguous slab of cache (stage 2's layout, num_key_value_heads wide) up to its own
  length; the rest of the slab holds whatever an earlier request left there, NaN included. GQA's
  saving is here: at decode, attention reads the whole cache for one token of compute, so it reads
  num_key_value_heads / num_attention_heads of MHA's bytes (per decode step at 4,096 tokens, batch
  16, Llama-3.1-8B in bf16: 32 GiB MHA, 8 GiB GQA, 1 GiB MQA; `kvlab size` gives the bytes a
  token). The grouping
  of the query heads is given (`group_query_heads`, the notebook's view); the rest is yours.
* `pool_groups`: a conversion in which *any* heads may share a KV head, not only adjacent ones.
  Query head h reads KV head h // P, so the query heads of a group must first be made adjacent:
  move each one's q_proj rows, and its o_proj columns with them (the layer then computes exactly
  what it did), then mean-pool each group's K and V heads. Adjacent groups give back the
  notebook's conversion.

Once `kvlab check 3` passes, try groupings in the notebook, after its section 3 (the notebook's
folder is the working directory):

    import runpy
    from kvlab.gqa import convert_layers
    mine = runpy.run_path("../exercises/stage3_grouped_query_attention.py")
    groups = [[0, 4, 1, 5], [2, 6, 3, 7]]  # every layer; or a list per layer, by layer_index
    model = convert_layers(tiny_mha32, 2, lambda layer_index, weights: mine["pool_groups"](
        weights, groups, tiny_mha32.config.head_dim))

and score it as section 3 scores mean-pooling, before and after `uptrain(model, train_ids, 48)`.
Do heads whose keys look alike (say, the cosine similarity of the keys each head computes on
`unseen_ids`) pool with less damage than adjacent ones? Does uptraining erase the difference?

`kvlab check 3` compares `decode_attention` with PyTorch's `scaled_dot_product_attention` over
repeated K/V for each request on its own (`kvlab.oracles.sdpa_attention`, in float64), and
`pool_groups` with `kvlab.gqa.mean_pool_kv_heads` on adjacent groups, with the logits of the
original model (a grouping of one head each moves heads and must change no output), and with a
model whose heads the grader moved itself before mean-pooling them.

Layout, as in the notebook: per-head tensors are [..., num_heads, head_dim]; query head
h = kv * G + g is the g-th head of KV head kv's group (adjacent query heads share a KV head, as in
HF Llama and vLLM). nn.Linear weights are [out_features, in_features]: head h owns rows
h*head_dim .. (h+1)*head_dim - 1 of q_proj, k_proj and v_proj, and the same columns of o_proj.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def group_query_heads(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[num_seqs, num_attention_heads, head_dim] -> [num_seqs, num_kv_heads, G, head_dim], a view
    (given: the notebook's grouping): [:, k] holds the G query heads that read KV head k."""
    num_seqs, num_heads, head_dim = query.shape
    return query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor:
    """One decode step of grouped-query attention for a batch of requests, each in its own slab.

        out[i, h] = softmax_s( query[i, h] . k_cache[i, s, h // G] / sqrt(head_dim) )
                    @ v_cache[i, s, h // G],   over s < context_lens[i]

    The newest token is already written at slot context_lens[i] - 1, so it sees itself. Slots
    from context_lens[i] on belong to no one: they may hold anything, NaN and inf included, and
    must not change the result (0 x NaN is NaN: masking the scores alone is not enough). Use
    `group_query_heads`; do not copy K/V once per query head (no `repeat_kv`,
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
    # BEGIN SOLUTION hint: score each request's grouped query heads against its own slab's keys in
    # hint: one einsum (a batch index beside the notebook's); -inf past each request's length; zero
    # hint: the values no one may read (0 x NaN is NaN) before the weighted sum; undo the grouping
    num_seqs, num_heads, head_dim = query.shape
    max_model_len, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    if bool((context_lens < 1).any()) or bool((context_lens > max_model_len).any()):
        raise ValueError(f"context lengths {context_lens.tolist()} must lie in "
                         f"[1, max_model_len={max_model_len}]")
    held = torch.arange(max_model_len, device=query.device) < context_lens[:, None]  # [B, L]

    per_kv_head = group_query_heads(query, num_kv_heads)
    scores = torch.einsum("bkgd,blkd->bkgl", per_kv_head, k_cache) / math.sqrt(head_dim)
    scores = scores.masked_fill(~held[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    values = v_cache.masked_fill(~held[:, :, None, None], 0.0)  # a left-over NaN times 0 is NaN
    out = torch.einsum("bkgl,blkd->bkgd", weights, values)
    return out.reshape(num_seqs, num_heads, head_dim)
    # END SOLUTION


def pool_groups(weights: dict[str, torch.Tensor], groups: Sequence[Sequence[int]],
                head_dim: int) -> dict[str, torch.Tensor]:
    """One MHA attention layer -> GQA with len(groups) KV heads, each shared by the heads of one
    group (any heads, not only adjacent ones).

    With H heads and P = H // len(groups) heads per group, the new layer's query heads
    j*P .. j*P + P - 1 are the old heads groups[j][0], ..., groups[j][P - 1], in that order
    (q_proj's rows and o_proj's columns of each head move together), and its KV head j is the
    mean of the old K (and V) heads in groups[j]. groups = [[0, 1, 2, 3], [4, 5, 6, 7]] is the
    notebook's mean-pooling; groups of one head each only reorder the heads (same outputs).

    Args:
        weights: {"q_proj": [H*head_dim, hidden], "k_proj": [H*head_dim, hidden],
            "v_proj": [H*head_dim, hidden], "o_proj": [hidden, H*head_dim]} (nn.Linear weights of
            an MHA layer: as many KV heads as query heads).
        groups: a partition of range(H) into groups of one size (lists or tuples of ints).
        head_dim: channels per head.

    Returns:
        The same keys: q_proj and o_proj the shapes they had; k_proj and v_proj
        [len(groups)*head_dim, hidden]; every tensor in its input's dtype.

    Raises:
        ValueError: the layer is not MHA (k_proj's rows differ from q_proj's); groups is not a
            partition of range(H) (a head missing, repeated or out of range) or its groups differ
            in size (the message names the heads or sizes).
    """
    # BEGIN SOLUTION hint: check the groups (a partition of the heads, one size); list the old heads
    # hint: in their new order; a view with a head axis lets one index move whole heads (q_proj's
    # hint: rows, o_proj's columns); then view the moved K/V heads as [groups, P, ...] and average
    q, k, v, o = (weights[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if q.shape != k.shape:
        raise ValueError(f"pool_groups converts MHA: q_proj {list(q.shape)} and k_proj "
                         f"{list(k.shape)} must hold as many heads")
    num_heads = k.shape[0] // head_dim
    order = [int(head) for group in groups for head in group]
    if sorted(order) != list(range(num_heads)):
        raise ValueError(f"groups {[list(g) for g in groups]} must hold each of the {num_heads} "
                         f"heads 0..{num_heads - 1} once")
    sizes = sorted({len(group) for group in groups})
    if len(sizes) != 1:
        raise ValueError(f"groups must be of one size, got sizes {sizes}")
    new_order = torch.tensor(order, device=q.device)

    def move(weight: torch.Tensor) -> torch.Tensor:  # [H*D, hidden] rows, whole heads at a time
        return weight.view(num_heads, head_dim, -1)[new_order]  # [H, D, hidden]

    def pool(weight: torch.Tensor) -> torch.Tensor:
        by_group = move(weight).view(len(groups), sizes[0], head_dim, -1)
        return by_group.mean(dim=1).reshape(len(groups) * head_dim, -1)

    moved_o = o.view(o.shape[0], num_heads, head_dim)[:, new_order].reshape(o.shape)
    return {"q_proj": move(q).reshape(q.shape), "k_proj": pool(k), "v_proj": pool(v),
            "o_proj": moved_o}
    # END SOLUTION
