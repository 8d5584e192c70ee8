"""Stage 1 exercise: the pieces of a Llama decoder layer, written as plain functions.

You write RMSNorm, rotary position embeddings (RoPE), causal attention and the SwiGLU MLP. Each is
a few lines of PyTorch; `kvlab check 1` compares yours with the course's own decoder
(`kvlab.model.RMSNorm`, `kvlab.model.RotaryEmbedding`, `kvlab.model.MLP`) and with PyTorch's
`scaled_dot_product_attention` computed in float64. Read `src/kvlab/model.py` afterwards and
compare.

Layout, as in `kvlab.model` (and vLLM): the tokens of one sequence lie flat along dim 0, so
per-head tensors are [num_tokens, num_heads, head_dim] and `positions` is [num_tokens] int64.
There is no batch dimension and no KV cache yet: attention sees the whole sequence every time.
"""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) over the last dimension, as Llama applies it.

        out = weight * x / sqrt(mean(x^2 over the last dim) + eps)

    Compute the normalisation in float32 (`x.float()`) even for bf16/fp16 input, cast the
    normalised values back to x's dtype, then multiply by `weight` (this is the order HF Llama
    and `kvlab.model.RMSNorm` use, so the results match bit for bit).

    Args:
        x: [..., hidden_size], any float dtype.
        weight: [hidden_size], the learned per-channel scale.
        eps: small constant inside the square root (Llama: 1e-5 or 1e-6).

    Returns:
        [..., hidden_size], the dtype of `weight * x` (x's dtype when both match).
    """
    # BEGIN SOLUTION hint: scale each vector by 1 / its root mean square over the last dim (eps
    # hint: inside the root); keep the docstring's order (float32, back to x's dtype, weight last)
    # hint: to match bit for bit
    x32 = x.float()
    mean_square = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = x32 * torch.rsqrt(mean_square + eps)
    return weight * normed.to(x.dtype)
    # END SOLUTION


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021) in the "rotate half" layout of HF Llama.

    Split each head's `head_dim` channels into a first and a second half. Channel i of the first
    half and channel i of the second half form a pair, rotated by the angle

        angle(p, i) = p * theta ** (-2 * i / head_dim),   i = 0 .. head_dim/2 - 1

    for a token at position p:

        out_first  = first * cos(angle) - second * sin(angle)
        out_second = second * cos(angle) + first * sin(angle)

    Every head of a token gets the same rotation. Compute in float32 and return x's dtype.

    Args:
        x: [num_tokens, num_heads, head_dim] queries or keys; head_dim must be even.
        positions: [num_tokens] int64, the absolute position of each token.
        theta: the RoPE base (`rope_theta` in config.json; Llama 2: 10,000, Llama 3: 500,000).

    Returns:
        [num_tokens, num_heads, head_dim], dtype of x.

    Raises:
        ValueError: head_dim is odd (channels could not be paired).
    """
    # BEGIN SOLUTION hint: each (first-half, second-half) channel pair turns by position x its own
    # hint: frequency, slower for later pairs; a token's angles are the same for every head, so
    # hint: broadcast them over heads
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even to pair channels, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim
    inv_freq = 1.0 / (theta ** exponents)                        # [D/2]
    angles = positions.float()[:, None] * inv_freq[None, :]      # [T, D/2]
    cos = angles.cos()[:, None, :]                               # [T, 1, D/2], same for every head
    sin = angles.sin()[:, None, :]
    first, second = x.float().chunk(2, dim=-1)                   # [T, H, D/2] each
    out_first = first * cos - second * sin
    out_second = second * cos + first * sin
    return torch.cat([out_first, out_second], dim=-1).to(x.dtype)
    # END SOLUTION


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention of one sequence, multi-head (a K/V head per query head).

    For every head h and query token i:

        scores[i, j] = q[i, h] . k[j, h] / sqrt(head_dim)   for j <= i (j > i is masked out)
        out[i, h]    = sum_j softmax_j(scores[i, :]) * v[j, h]

    Token i sees itself and the tokens before it, never later ones: that is what lets a decoder
    generate left to right, and why a token's K and V never change once computed (stage 2 caches
    them). Compute in the input dtype (the tests use float64).

    Args:
        q, k, v: [num_tokens, num_heads, head_dim], the same shape and dtype. Token i is at
            position i.

    Returns:
        [num_tokens, num_heads, head_dim], dtype of q.
    """
    # BEGIN SOLUTION hint: scaled dot-product attention for each head: a query scores every key,
    # hint: scaled by 1/sqrt(head_dim); causal: a later key must get zero weight, so mask it before
    # hint: the softmax
    num_tokens, _, head_dim = q.shape
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [H, T, D]
    scores = qh @ kh.transpose(1, 2) / math.sqrt(head_dim)                  # [H, T, T]
    future = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vh).transpose(0, 1)                                     # [T, H, D]
    # END SOLUTION


def swiglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               down_weight: torch.Tensor) -> torch.Tensor:
    """The SwiGLU feed-forward block of Llama (Shazeer, 2020):

        out = down_proj( silu(gate_proj(x)) * up_proj(x) ),   silu(z) = z * sigmoid(z)

    The weights are laid out as `torch.nn.Linear` stores them, [out_features, in_features], so
    a projection is `x @ weight.T` (no biases).

    Args:
        x: [num_tokens, hidden_size].
        gate_weight, up_weight: [intermediate_size, hidden_size].
        down_weight: [hidden_size, intermediate_size].

    Returns:
        [num_tokens, hidden_size], dtype of x.
    """
    # BEGIN SOLUTION hint: SwiGLU: the SiLU of the gate projection gates the up projection
    # hint: elementwise, and the down projection maps back to hidden_size; an nn.Linear weight is
    # hint: [out_features, in_features]
    gate = x @ gate_weight.T
    up = x @ up_weight.T
    return (torch.nn.functional.silu(gate) * up) @ down_weight.T
    # END SOLUTION
