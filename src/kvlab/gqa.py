"""Turn a multi-head (MHA) checkpoint into grouped-query attention (GQA) by mean-pooling.

Ainslie et al. (EMNLP 2023), section 2.1: from H KV heads to H / G, average the K and V projections
of each group of G adjacent heads, so new KV head j is the mean of old heads j*G ... j*G + G - 1
(query head h reads h // G, `kvlab.attention`). The paper then uptrains on ~5 % of the original
compute; the course does not, so the raw cost of sharing shows as perplexity (`kvlab.evaluate`).
"""

from __future__ import annotations

import copy

import torch

from .model import LlamaForCausalLM

__all__ = ["mean_pool_kv_heads", "convert_to_gqa"]


def mean_pool_kv_heads(weight: torch.Tensor, num_kv_heads: int, head_dim: int,
                       new_num_kv_heads: int) -> torch.Tensor:
    """k_proj / v_proj [num_kv_heads * head_dim, hidden_size] (head j's rows contiguous) ->
    [new_num_kv_heads * head_dim, hidden_size]; ValueError: the new count does not divide the old."""
    if new_num_kv_heads < 1 or num_kv_heads % new_num_kv_heads:
        raise ValueError(f"cannot pool {num_kv_heads} KV heads into {new_num_kv_heads}: "
                         f"the new count must divide the old one")
    group = num_kv_heads // new_num_kv_heads
    hidden = weight.shape[1]
    heads = weight.view(new_num_kv_heads, group, head_dim, hidden)
    return heads.mean(dim=1).reshape(new_num_kv_heads * head_dim, hidden)


@torch.no_grad()
def convert_to_gqa(model: LlamaForCausalLM, num_key_value_heads: int) -> LlamaForCausalLM:
    """A copy with K/V projections mean-pooled to num_key_value_heads (1 = MQA), the rest unchanged.
    ValueError: it does not divide the model's KV heads (or num_attention_heads)."""
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
