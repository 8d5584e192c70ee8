"""Turn a multi-head (MHA) checkpoint into grouped-query attention (GQA) by mean-pooling.

Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints" (EMNLP 2023), section 2.1: to go from H KV heads to H / G, average the key and value
projection matrices of each group of G adjacent heads. The paper then "uptrains" for about 5 % of
the original compute to recover quality; the course skips uptraining so the learner sees the raw
cost of sharing heads, measured as perplexity on held-out text (`kvlab.evaluate.perplexity`).

Grouping follows the GQA mapping: query head h reads KV head h // G, so KV head j of the new model
is the mean of old KV heads j*G ... j*G + G - 1 (the ones whose query heads it now serves).
"""

from __future__ import annotations

import copy

import torch

from .model import LlamaForCausalLM

__all__ = ["mean_pool_kv_heads", "convert_to_gqa"]


def mean_pool_kv_heads(weight: torch.Tensor, num_kv_heads: int, head_dim: int,
                       new_num_kv_heads: int) -> torch.Tensor:
    """Average a k_proj / v_proj weight over groups of adjacent heads.

    Args:
        weight: [num_kv_heads * head_dim, hidden_size], the nn.Linear weight (rows = output channels,
            head-major: rows j*head_dim ... (j+1)*head_dim - 1 belong to head j).
        new_num_kv_heads: heads after pooling; must divide num_kv_heads.

    Returns:
        [new_num_kv_heads * head_dim, hidden_size], same dtype.

    Raises:
        ValueError: new_num_kv_heads does not divide num_kv_heads.
    """
    if new_num_kv_heads < 1 or num_kv_heads % new_num_kv_heads:
        raise ValueError(f"cannot pool {num_kv_heads} KV heads into {new_num_kv_heads}: "
                         f"the new count must divide the old one")
    group = num_kv_heads // new_num_kv_heads
    hidden = weight.shape[1]
    heads = weight.view(new_num_kv_heads, group, head_dim, hidden)
    return heads.mean(dim=1).reshape(new_num_kv_heads * head_dim, hidden)


@torch.no_grad()
def convert_to_gqa(model: LlamaForCausalLM, num_key_value_heads: int) -> LlamaForCausalLM:
    """A copy of `model` with num_key_value_heads KV heads, K/V projections mean-pooled per group.

    num_key_value_heads = 1 gives multi-query attention (MQA). The query, output and MLP weights are
    unchanged; the KV cache of the result is smaller by old_heads / new_heads.

    Raises:
        ValueError: num_key_value_heads does not divide the model's KV heads
            (or num_attention_heads).
    """
    config = model.config
    new_config = config.with_changes(num_key_value_heads=num_key_value_heads)
    converted = LlamaForCausalLM(new_config).to(model.dtype).to(model.device)
    state = copy.copy(model.state_dict())
    for name, tensor in list(state.items()):
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            state[name] = mean_pool_kv_heads(tensor, config.num_key_value_heads, config.head_dim,
                                             num_key_value_heads)
    converted.load_state_dict(state)
    if new_config.tie_word_embeddings:
        converted.lm_head.weight = converted.model.embed_tokens.weight
    return converted.eval()
