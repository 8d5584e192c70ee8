"""Stage 1: RMSNorm, RoPE, causal attention and SwiGLU, checked against `kvlab.model` and SDPA.

Grades `stage1_tiny_llama.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 1`.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.tools.grading import assert_close, expect_raises
from kvlab.model import MLP, RMSNorm, RotaryEmbedding


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage1_tiny_llama.py")


def randn(*shape, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def describe(name, **tensors_and_values):
    """'rms_norm(x [5, 16] float32, eps=1e-05)' for failure messages."""
    parts = []
    for key, value in tensors_and_values.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{key} {list(value.shape)} {str(value.dtype).replace('torch.', '')}")
        else:
            parts.append(f"{key}={value}")
    return f"{name}({', '.join(parts)})"


def tensor(value, what):
    """`value` when it is a tensor; else a readable failure (before we slice it)."""
    if not isinstance(value, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {value!r}")
    return value


# ---- rms_norm ---------------------------------------------------------------------------------

def rms_norm_float64(x, weight, eps):
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape, eps", [((5, 16), 1e-5), ((2, 3, 8), 1e-6), ((1, 64), 1e-5)],
                         ids=["5x16", "2x3x8", "1x64"])
def test_rms_norm_matches_kvlab(ex, shape, eps):
    x, weight = randn(*shape, seed=1), randn(shape[-1], seed=2)
    norm = RMSNorm(shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        expected = norm(x)
    what = describe("rms_norm", x=x, weight=weight, eps=eps) + " vs kvlab.model.RMSNorm"
    assert_close(ex.rms_norm(x, weight, eps), expected, what, atol=1e-5, rtol=1e-5)
    assert_close(ex.rms_norm(x, weight, eps), rms_norm_float64(x, weight, eps).float(),
                 what.replace("kvlab.model.RMSNorm", "the formula in float64"),
                 atol=1e-5, rtol=1e-5)


def test_rms_norm_eps_inside_the_square_root(ex):
    # mean(x^2) = 1e-6, so eps = 1 dominates: out = x / sqrt(1e-6 + 1).
    x, weight, eps = torch.full((2, 4), 1e-3), torch.ones(4), 1.0
    expected = torch.full((2, 4), 1e-3 / math.sqrt(1e-6 + 1.0))
    assert_close(ex.rms_norm(x, weight, eps), expected,
                 describe("rms_norm", x=x, weight=weight, eps=eps) + " with x = 0.001 everywhere",
                 atol=1e-8, rtol=1e-5)


def test_rms_norm_of_zeros_is_zero_not_nan(ex):
    x, weight = torch.zeros(3, 8), torch.ones(8)
    assert_close(ex.rms_norm(x, weight, 1e-5), torch.zeros(3, 8),
                 describe("rms_norm", x=x, weight=weight, eps=1e-5) + " with x = 0")


def test_rms_norm_bf16_keeps_dtype(ex):
    x, weight = randn(4, 32, seed=3, dtype=torch.bfloat16), randn(32, seed=4,
                                                                 dtype=torch.bfloat16)
    norm = RMSNorm(32, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
        expected = norm(x)
    assert_close(ex.rms_norm(x, weight, 1e-5), expected,
                 describe("rms_norm", x=x, weight=weight, eps=1e-5) + " vs kvlab.model.RMSNorm",
                 atol=2e-2, rtol=2e-2)


# ---- apply_rope -------------------------------------------------------------------------------

def rope_float64(x, positions, theta):
    """The rotate-half formula, written out in float64."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    angles = positions.double()[:, None] * theta ** (-2 * i / head_dim)  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x.double()[..., :half], x.double()[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.mark.parametrize("num_tokens, num_heads, head_dim, theta", [
    (6, 3, 16, 10000.0), (5, 2, 64, 500000.0), (1, 1, 2, 10000.0)])
def test_apply_rope_matches_kvlab(ex, num_tokens, num_heads, head_dim, theta):
    x = randn(num_tokens, num_heads, head_dim, seed=5)
    positions = torch.arange(num_tokens)
    expected = RotaryEmbedding(head_dim, theta)(x, positions)
    what = (describe("apply_rope", x=x, positions=positions, theta=theta)
            + " at positions 0..T-1 vs kvlab.model.RotaryEmbedding")
    assert_close(ex.apply_rope(x, positions, theta), expected, what, atol=1e-5, rtol=1e-5)


def test_apply_rope_any_positions(ex):
    # Decode steps and packed requests give positions that neither start at 0 nor run in order.
    x = randn(4, 2, 8, seed=6)
    positions = torch.tensor([17, 0, 5, 100])
    what = describe("apply_rope", x=x, positions=positions, theta=10000.0) + \
        " at positions [17, 0, 5, 100] vs the formula in float64"
    assert_close(ex.apply_rope(x, positions, 10000.0), rope_float64(x, positions, 10000.0).float(),
                 what, atol=1e-4, rtol=1e-4)


def test_apply_rope_position_zero_is_identity(ex):
    x = randn(3, 2, 8, seed=7)
    positions = torch.zeros(3, dtype=torch.long)
    assert_close(ex.apply_rope(x, positions, 10000.0), x,
                 describe("apply_rope", x=x, positions=positions, theta=10000.0)
                 + " at position 0 (angle 0: no rotation)", atol=1e-6, rtol=1e-6)


def test_apply_rope_depends_only_on_relative_position(ex):
    # The point of RoPE: q at m and k at n score by m - n alone. (3, 1) and (40, 38) must agree.
    q, k = randn(1, 1, 16, seed=8), randn(1, 1, 16, seed=9)

    def score(m, n):
        rq = ex.apply_rope(q, torch.tensor([m]), 10000.0)
        rk = ex.apply_rope(k, torch.tensor([n]), 10000.0)
        return (rq * rk).sum().reshape(1)

    assert_close(score(40, 38), score(3, 1),
                 "apply_rope: q . k with q at position 40, k at 38 vs q at 3, k at 1 (both 2 "
                 "apart)", atol=1e-4, rtol=1e-4)


def test_apply_rope_bf16_keeps_dtype(ex):
    x = randn(4, 2, 8, seed=10, dtype=torch.bfloat16)
    positions = torch.arange(4)
    expected = RotaryEmbedding(8, 10000.0)(x, positions)
    assert_close(ex.apply_rope(x, positions, 10000.0), expected,
                 describe("apply_rope", x=x, positions=positions, theta=10000.0)
                 + " vs kvlab.model.RotaryEmbedding", atol=2e-2, rtol=2e-2)


def test_apply_rope_odd_head_dim_raises(ex):
    x = randn(2, 1, 5, seed=11)
    expect_raises(ValueError, lambda: ex.apply_rope(x, torch.arange(2), 10000.0),
                  describe("apply_rope", x=x, positions=torch.arange(2), theta=10000.0)
                  + " with odd head_dim=5")


# ---- causal_attention -------------------------------------------------------------------------

def sdpa_causal(q, k, v):
    """PyTorch's scaled_dot_product_attention, causal, on [T, H, D] tensors."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(7, 4, 8), (1, 2, 16), (16, 1, 4)])
def test_causal_attention_matches_sdpa_float64(ex, num_tokens, num_heads, head_dim):
    q, k, v = (randn(num_tokens, num_heads, head_dim, seed=s, dtype=torch.float64)
               for s in (12, 13, 14))
    what = describe("causal_attention", q=q, k=k, v=v) + " vs torch SDPA (is_causal) in float64"
    assert_close(ex.causal_attention(q, k, v), sdpa_causal(q, k, v), what, atol=1e-10,
                 rtol=1e-10)


def test_causal_attention_first_token_sees_only_itself(ex):
    q, k, v = (randn(5, 2, 4, seed=s, dtype=torch.float64) for s in (15, 16, 17))
    what = "causal_attention: output of token 0 (it sees only itself, so it equals v[0])"
    out = tensor(ex.causal_attention(q, k, v), what)
    assert_close(out[:1], v[:1], what, atol=1e-12, rtol=1e-12)


def test_causal_attention_ignores_the_future(ex):
    q, k, v = (randn(6, 2, 4, seed=s, dtype=torch.float64) for s in (18, 19, 20))
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = 100.0, -100.0  # change only tokens 4 and 5
    what = "causal_attention: tokens 0-3 after changing k, v of tokens 4-5 (the future)"
    before = tensor(ex.causal_attention(q, k, v), what)
    after = tensor(ex.causal_attention(q, k2, v2), what)
    assert_close(after[:4], before[:4], what, atol=1e-12, rtol=1e-12)


# ---- swiglu_mlp -------------------------------------------------------------------------------

def test_swiglu_mlp_matches_kvlab(ex):
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=20, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    torch.manual_seed(21)
    mlp = MLP(config).double()
    x = randn(5, 8, seed=22, dtype=torch.float64)
    with torch.no_grad():
        expected = mlp(x)
        got = ex.swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    what = (describe("swiglu_mlp", x=x, gate_weight=mlp.gate_proj.weight,
                     up_weight=mlp.up_proj.weight, down_weight=mlp.down_proj.weight)
            + " vs kvlab.model.MLP in float64")
    assert_close(got, expected, what, atol=1e-12, rtol=1e-12)
