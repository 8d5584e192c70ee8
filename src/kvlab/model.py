"""A Llama-style decoder, small enough to read in one sitting.

The pieces are the ones in Touvron et al., "LLaMA" (2023), section 2.2, and Llama 2/3 after it:
RMSNorm before each block (Zhang & Sennrich, 2019), rotary position embeddings at absolute positions
(RoPE; Su et al., 2021), a SwiGLU feed-forward block (Shazeer, 2020) and attention whose key/value
heads may be shared by groups of query heads (GQA; Ainslie et al., 2023). Parameter names match
Hugging Face's `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...), so a published
checkpoint loads with no renaming (`kvlab.checkpoint`).

Tokens are laid out flat, as vLLM does: token_ids and positions are [num_tokens]. Where keys and
values live is not the model's business: each attention layer hands its new K/V to a *KV store*
(`NoCache`, a contiguous slab, a paged block pool, ...) and gets the attention output back. That
one seam is what the whole course turns.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from .attention import grouped_attention
from .config import ConfigError, LlamaConfig

__all__ = ["KVStore", "NoCache", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding",
           "check_model_supported"]


class KVStore(Protocol):
    """Where attention keeps keys and values. Every cache in the course implements this."""

    def attend(self, layer_index: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V of `layer_index`, attend `query` over everything stored: query
        and the output [num_tokens, num_attention_heads, head_dim]; key, value [num_tokens,
        num_key_value_heads, head_dim]; positions [num_tokens] int64."""
        ...


class NoCache:
    """No cache: each pass recomputes every K/V (O(n^2) projections); every cache's reference."""

    def attend(self, layer_index, query, key, value, positions):
        return grouped_attention(query, key, value, query_positions=positions,
                                 key_positions=positions)


def check_model_supported(config: LlamaConfig) -> None:
    """ConfigError for maths this decoder lacks (RoPE scaling such as Llama 3.1's, a non-Llama
    architecture, attention biases), instead of wrong logits."""
    if config.rope_type != "default":
        raise ConfigError(
            f"{config.name}: rope_scaling of type {config.rope_type!r} is not implemented by "
            f"kvlab's decoder (plain RoPE only); the size calculator still accepts this config")
    if config.model_type not in ("llama", "mistral"):
        raise ConfigError(f"{config.name}: model_type {config.model_type!r} is not a Llama-style "
                          f"decoder kvlab implements (llama, mistral)")
    if config.attention_bias:
        raise ConfigError(f"{config.name}: attention_bias=True is not implemented")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim [..., hidden_size], computed in float32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is exactly x32 * rsqrt(mean(x32^2) + eps), in one op instead of five (it runs
        # twice per layer per step); the weight multiplies after rounding back, as in HF's Llama.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., 2021), HF Llama's "rotate half" layout: channels i and i + head_dim / 2
    are rotated together by position * theta^(-2i / head_dim)."""

    def __init__(self, head_dim: int, rope_theta: float):
        super().__init__()
        self.head_dim, self.rope_theta = head_dim, rope_theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """float32 [head_dim / 2]; recomputed, not a buffer, so `model.to(torch.bfloat16)` cannot
        round it (in bf16 the angle at position 4,000 would be off by up to ~0.7 rad)."""
        exponents = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        return 1.0 / (self.rope_theta ** exponents)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [num_tokens, 1, head_dim] of positions [num_tokens]: the same for
        every layer, so a forward pass computes them once (as HF's `LlamaModel` does)."""
        angles = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]      # [T, 1, D]
        return angles.cos(), angles.sin()

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [num_tokens, num_heads, head_dim] rotated by `cos_sin(positions)`, same shape."""
        cos, sin = cos_sin
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        rotated_half = torch.cat([-second, first], dim=-1)
        return (x32 * cos + rotated_half * sin).to(x.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, num_heads, head_dim], positions [num_tokens] -> rotated x, same shape."""
        return self.rotate(x, self.cos_sin(positions))


class Attention(nn.Module):
    """Multi-head attention with num_key_value_heads <= num_attention_heads (MHA, GQA or MQA)."""

    def __init__(self, config: LlamaConfig, layer_index: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KVStore,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """cos_sin: `rope.cos_sin(positions)`, if the caller computed it once for every layer."""
        num_tokens = x.shape[0]
        query, key, value = self.qkv(x)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if cos_sin is None:
            cos_sin = self.rope.cos_sin(positions)
        query, key = self.rope.rotate(query, cos_sin), self.rope.rotate(key, cos_sin)
        out = kv.attend(self.layer_index, query, key, value, positions)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k, v projections: one matmul in `kvlab.cpu_linear` (vLLM's QKVParallelLinear)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class MLP(nn.Module):
    """SwiGLU feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(nn.functional.silu(gate) * up)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate and up projections: one matmul in `cpu_linear` (MergedColumnParallelLinear)."""
        return self.gate_proj(x), self.up_proj(x)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, layer_index: int, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KVStore,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv, cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Embedding, the decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.rope = rope = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rope)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv: KVStore) -> torch.Tensor:
        x = self.embed_tokens(token_ids)
        cos_sin = self.rope.cos_sin(positions)  # one rotation table for all layers
        for layer in self.layers:
            x = layer(x, positions, kv, cos_sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head; ConfigError at construction (`check_model_supported`)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        check_model_supported(config)
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv: KVStore | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [num_tokens, vocab_size] of token_ids [num_tokens] at absolute positions
        (default 0 .. num_tokens - 1) through kv (default `NoCache()`: one whole sequence).
        logits_indices [num_rows] int64: only those rows ([num_rows, vocab_size]), as vLLM samples
        only after each request's last scheduled token; the vocabulary projection is a small
        model's largest matmul, so a 1,000-token prefill that needs one row skips 999."""
        if positions is None:
            positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        hidden = self.model(token_ids, positions, kv if kv is not None else NoCache())
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden).float()

    @property
    def weights_bytes(self) -> int:
        """Exact bytes of the parameters (a tied embedding counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype
