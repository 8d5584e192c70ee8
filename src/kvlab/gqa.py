"""Turn a multi-head (MHA) checkpoint into grouped-query attention (GQA): mean-pool, then uptrain.

Ainslie et al. (EMNLP 2023), section 2.1: from H KV heads to H / G, average the K and V projections
of each group of G adjacent heads, so new KV head j is the mean of old heads j*G ... j*G + G - 1
(query head h reads h // G, `kvlab.attention`). The converted model is then *uptrained*: its
pre-training continues, same recipe and data, for a fraction alpha of the original steps (alpha =
5 % in the paper, section 3.1), which recovers most of what the pooling cost (table 1: T5-XXL
uptrained to GQA-8 scores 47.1 against MHA's 47.2; figure 5: MQA needs it to be useful at all).
Adjacent groups are the paper's choice, not a necessity: any heads can share a KV head once their
query heads are made adjacent, moving each query head's q_proj rows and o_proj columns together,
which changes no output (`convert_layers` applies such a conversion layer by layer; stage 3's
exercise writes one). `uptrain` is the continuation at the tiny model's scale, with
scripts/train_tiny.py's optimiser (AdamW, betas 0.9/0.95, weight decay 0.1, clipping at 1.0,
warm-up then cosine to a tenth) on random windows of its training text; its cost in tokens (steps x
batch_size x seq_len) is what compares with the original training's. Continue at the rate
pre-training ended at (scripts/train_tiny.py: 3e-4, a tenth of its 3e-3 peak): a rate warmed back
up to the peak shakes a trained model out of the minimum it settled in. It trains in float32 on
any device: bfloat16 keeps 8 significant bits, so an update under about 0.2 % of a weight (most of
AdamW's steps late in a schedule) rounds away to nothing.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import torch

from .model import LlamaForCausalLM

__all__ = ["mean_pool_kv_heads", "convert_to_gqa", "convert_layers", "ATTENTION_WEIGHTS",
           "PackedSequences", "uptrain"]

ATTENTION_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj")  # a layer's, for convert_layers


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
def convert_to_gqa(model: LlamaForCausalLM, num_key_value_heads: int,
                   pool: Callable[[torch.Tensor, int, int, int], torch.Tensor] = mean_pool_kv_heads
                   ) -> LlamaForCausalLM:
    """A copy with K/V projections pooled to num_key_value_heads (1 = MQA), the rest unchanged;
    pool(weight, num_kv_heads, head_dim, new_num_kv_heads) as `mean_pool_kv_heads` (the default),
    for another conversion (the paper's section 3.3 also keeps one head per group). ValueError: it
    does not divide the model's KV heads (or num_attention_heads)."""
    config = model.config
    new_config = config.with_changes(num_key_value_heads=num_key_value_heads)
    converted = LlamaForCausalLM(new_config).to(model.dtype).to(model.device)
    state = copy.copy(model.state_dict())
    for name, tensor in list(state.items()):
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            state[name] = pool(tensor, config.num_key_value_heads, config.head_dim,
                               num_key_value_heads)
    converted.load_state_dict(state)
    if new_config.tie_word_embeddings:
        converted.lm_head.weight = converted.model.embed_tokens.weight
    return converted.eval()


@torch.no_grad()
def convert_layers(model: LlamaForCausalLM, num_key_value_heads: int,
                   convert: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                   ) -> LlamaForCausalLM:
    """A copy with num_key_value_heads KV heads whose attention weights are, layer by layer,
    convert(layer_index, {"q_proj": w, "k_proj": w, "v_proj": w, "o_proj": w}) (nn.Linear weights,
    [out_features, in_features]; the same keys back), the rest unchanged: for a conversion that
    also moves query heads, such as grouping heads that are not adjacent (moving q_proj's rows and
    o_proj's columns together changes no output). `convert_to_gqa` pools K/V alone.
    ValueError: convert returns other keys, or shapes that do not fit num_key_value_heads."""
    config = model.config
    new_config = config.with_changes(num_key_value_heads=num_key_value_heads)
    state = copy.copy(model.state_dict())
    for index in range(config.num_hidden_layers):
        names = {part: f"model.layers.{index}.self_attn.{part}.weight"
                 for part in ATTENTION_WEIGHTS}
        new = convert(index, {part: state[name] for part, name in names.items()})
        if sorted(new) != sorted(ATTENTION_WEIGHTS):
            raise ValueError(f"layer {index}: convert returned the keys {sorted(new)}, expected "
                             f"{sorted(ATTENTION_WEIGHTS)}")
        state.update({names[part]: weight for part, weight in new.items()})
    converted = LlamaForCausalLM(new_config).to(model.dtype).to(model.device)
    try:
        converted.load_state_dict(state)
    except RuntimeError as error:  # a shape that does not fit: say so as a ValueError
        raise ValueError(f"convert's weights do not fit {num_key_value_heads} KV heads: "
                         f"{str(error).splitlines()[-1].strip()}") from None
    if new_config.tie_word_embeddings:
        converted.lm_head.weight = converted.model.embed_tokens.weight
    return converted.eval()


class PackedSequences:
    """A KV store for training: batch_size independent sequences of seq_len tokens laid out flat
    ([batch_size * seq_len] tokens); causal attention inside each one, by PyTorch SDPA, whose
    enable_gqa lets each group of query heads read its KV head without a copy."""

    def __init__(self, batch_size: int, seq_len: int):
        self.batch_size, self.seq_len = batch_size, seq_len

    def attend(self, layer_index, query, key, value, positions):
        def split(x):  # [B * T, H, D] -> [B, H, T, D]
            return x.view(self.batch_size, self.seq_len, *x.shape[1:]).transpose(1, 2)

        out = torch.nn.functional.scaled_dot_product_attention(
            split(query), split(key), split(value), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(query.shape)


def uptrain(model: LlamaForCausalLM, token_ids: Sequence[int], steps: int, batch_size: int = 8,
            seq_len: int = 128, lr: float = 3e-4, warmup: int = 5, seed: int = 0) -> list[float]:
    """Continue training `model` in place on windows of token_ids (int, one long text), each step
    batch_size windows of seq_len + 1 tokens at offsets drawn from a CPU generator seeded with
    `seed` (the same windows on every device); returns the steps' training losses (float, nats per
    token) and leaves the model in eval mode. Deterministic on the CPU with one thread.
    ValueError: weights not float32, steps or batch_size < 1, seq_len outside
    [1, max_position_embeddings], or token_ids shorter than seq_len + 2."""
    if model.dtype != torch.float32:
        raise ValueError(f"uptrain needs float32 weights, got {model.dtype}: an update under "
                         f"0.2 % of a weight rounds away in bfloat16; load with "
                         f"dtype=torch.float32")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if not 1 <= seq_len <= model.config.max_position_embeddings:
        raise ValueError(f"seq_len must be in [1, {model.config.max_position_embeddings}], "
                         f"got {seq_len}")
    if len(token_ids) < seq_len + 2:
        raise ValueError(f"need more than seq_len + 1 = {seq_len + 1} tokens, got {len(token_ids)}")
    device = model.device
    data = torch.tensor(list(token_ids), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    store = PackedSequences(batch_size, seq_len)
    positions = torch.arange(seq_len, device=device).repeat(batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine from lr down to lr / 10
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    losses = []
    for step in range(steps):
        offsets = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([data[o:o + seq_len + 1] for o in offsets.tolist()]).to(device)
        logits = model(windows[:, :-1].reshape(-1), positions, store)
        loss = torch.nn.functional.cross_entropy(logits, windows[:, 1:].reshape(-1))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses
