"""Stage 1: RoPE in Meta's interleaved layout, checked against the complex-number formula in
float64, and the q_proj/k_proj row reordering to the rotate-half layout, checked by the q·k scores
it must keep, against `kvlab.gguf_loader.unpermute_rows` and on the tiny model's logits.

Grades `stage1_tiny_llama.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 1`.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.tools.grading import assert_close, assert_equal, expect_raises


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage1_tiny_llama.py")


def randn(*shape, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def describe(name, **tensors_and_values):
    """'rope_interleaved(x [5, 2, 8] float64, positions=[0, 3], theta=10000.0)' for messages."""
    parts = []
    for key, value in tensors_and_values.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            parts.append(f"{key} {list(value.shape)} {str(value.dtype).replace('torch.', '')}")
        elif isinstance(value, torch.Tensor):
            parts.append(f"{key}={value.tolist()}")
        else:
            parts.append(f"{key}={value}")
    return f"{name}({', '.join(parts)})"


def tensor(value, what):
    """`value` when it is a tensor; else a readable failure (before we slice it)."""
    if not isinstance(value, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {value!r}")
    return value


# ---- float64 references -----------------------------------------------------------------------

def angles_float64(positions, head_dim, theta, exponent=2.0):
    """[T, head_dim/2]: position p times theta^(-exponent * j / head_dim) (exponent 2 is RoPE)."""
    j = torch.arange(head_dim // 2, dtype=torch.float64)
    return positions.double()[:, None] * theta ** (-exponent * j / head_dim)


def rope_complex(x, positions, theta, exponent=2.0):
    """Meta's formula: each head's channels as complex numbers x[2j] + i x[2j+1], times
    e^(i p theta_j), in float64."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    angles = angles_float64(positions, x.shape[-1], theta, exponent)
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.view_as_real(turned).flatten(-2)


def rope_halves(x, positions, theta):
    """The page's rotate-half layout (channel j with j + head_dim/2), in float64."""
    half = x.shape[-1] // 2
    angles = angles_float64(positions, x.shape[-1], theta)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x.double()[..., :half], x.double()[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def evens_then_odds(head_dim):
    """[0, 2, 4, ..., 1, 3, 5, ...]: interleaved pair j (2j, 2j+1) at rotate-half's (j, j + D/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def to_meta_rows(weight, num_heads):
    """The grader's own inverse of the reordering: rotate-half rows back to Meta's order (what
    llama.cpp's converter does), by index: Meta row 2j + a of a head is HF row a * D/2 + j."""
    head_dim = weight.shape[0] // num_heads
    order = evens_then_odds(head_dim)
    meta = torch.empty_like(weight)
    for head in range(num_heads):
        meta[head * head_dim + order] = weight[head * head_dim: (head + 1) * head_dim]
    return meta


# ---- rope_interleaved -------------------------------------------------------------------------

def rope_hint(got, x, positions, theta):
    """What a wrong answer resembles, when it is one of the common slips."""
    if not isinstance(got, torch.Tensor) or got.shape != x.shape or not got.isfinite().all():
        return ""
    order = evens_then_odds(x.shape[-1])
    slips = [
        (" -- your output is the page's rotate-half layout (channel j with j + head_dim/2); "
         "interleaved RoPE pairs channels 2j and 2j + 1", rope_halves(x, positions, theta)),
        (" -- your output holds the right values, the even channels first and the odd ones after; "
         "put each pair back side by side (channels 2j, 2j + 1)",
         rope_complex(x, positions, theta)[..., order]),
        (" -- your output turns each pair the other way (by -angle); RoPE's is out[2j] = x[2j] "
         "cos - x[2j+1] sin, out[2j+1] = x[2j+1] cos + x[2j] sin",
         rope_complex(x, -positions, theta)),
        (" -- your pair j turns at theta^(-j / head_dim); RoPE's is theta^(-2j / head_dim)",
         rope_complex(x, positions, theta, exponent=1.0)),
        (" -- your output uses positions 0 .. num_tokens - 1, not the positions given",
         rope_complex(x, torch.arange(len(positions)), theta)),
    ]
    for message, slip in slips:
        if not torch.allclose(slip, rope_complex(x, positions, theta), atol=1e-9) and \
                torch.allclose(got.double(), slip, atol=1e-6, rtol=1e-6):
            return message
    return ""


def check_rope(ex, x, positions, theta, atol, rtol):
    expected = rope_complex(x, positions, theta).to(x.dtype)
    got = ex.rope_interleaved(x.clone(), positions.clone(), theta)
    what = (describe("rope_interleaved", x=x, positions=positions, theta=theta)
            + " vs (x[2j] + i x[2j+1]) e^(i p theta_j) in float64")
    try:
        assert_close(got, expected, what, atol=atol, rtol=rtol)
    except AssertionError as error:
        raise AssertionError(f"{error}{rope_hint(got, x, positions, theta)}") from None


def test_rope_interleaved_by_hand(ex):
    # Two pairs, position 1, theta 100: pair (0, 1) turns by 1 rad, pair (2, 3) by 100^(-1/2) = 0.1.
    x = torch.tensor([[[1.0, 0.0, 1.0, 0.0]]], dtype=torch.float64)
    expected = torch.tensor([[[math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)]]],
                            dtype=torch.float64)
    assert_close(ex.rope_interleaved(x, torch.tensor([1]), 100.0), expected,
                 "rope_interleaved(x=[[[1, 0, 1, 0]]], positions=[1], theta=100.0): pair (0, 1) "
                 "turns by 1 rad, pair (2, 3) by 100^(-2/4) = 0.1 rad", atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("num_tokens, num_heads, head_dim, theta, positions", [
    (6, 3, 16, 10000.0, None), (5, 2, 64, 500000.0, [17, 0, 5, 100, 4095]),
    (1, 1, 2, 10000.0, [3])], ids=["6x3x16", "5x2x64-any-positions", "1x1x2"])
def test_rope_interleaved_matches_complex_float64(ex, num_tokens, num_heads, head_dim, theta,
                                                  positions):
    x = randn(num_tokens, num_heads, head_dim, seed=5)
    positions = torch.arange(num_tokens) if positions is None else torch.tensor(positions)
    check_rope(ex, x, positions, theta, atol=1e-10, rtol=1e-10)


def test_rope_interleaved_float32_and_bf16_keep_dtype(ex):
    positions = torch.tensor([0, 1, 9, 30])
    check_rope(ex, randn(4, 2, 8, seed=6, dtype=torch.float32), positions, 10000.0,
               atol=1e-6, rtol=1e-6)
    check_rope(ex, randn(4, 2, 8, seed=7, dtype=torch.bfloat16), positions, 10000.0,
               atol=2e-2, rtol=2e-2)


def test_rope_interleaved_position_zero_is_identity(ex):
    x = randn(3, 2, 8, seed=8)
    positions = torch.zeros(3, dtype=torch.long)
    assert_close(ex.rope_interleaved(x, positions, 10000.0), x,
                 describe("rope_interleaved", x=x, positions=positions, theta=10000.0)
                 + " at position 0 (angle 0: no rotation)", atol=1e-12, rtol=1e-12)


def test_rope_interleaved_depends_only_on_relative_position(ex):
    # The point of RoPE in either layout: q at m and k at n score by m - n alone.
    q, k = randn(1, 1, 16, seed=9), randn(1, 1, 16, seed=10)

    def score(m, n):
        rq = tensor(ex.rope_interleaved(q, torch.tensor([m]), 10000.0), "rope_interleaved")
        rk = tensor(ex.rope_interleaved(k, torch.tensor([n]), 10000.0), "rope_interleaved")
        return (rq * rk).sum().reshape(1)

    what = "rope_interleaved: q . k with q at position 40, k at 38 vs q at 3, k at 1 (both 2 apart)"
    near = score(3, 1)
    if not near.isfinite().all():
        raise AssertionError(f"{what}: q . k at 3 and 1 is {near.item()}, not a number")
    assert_close(score(40, 38), near, what, atol=1e-10, rtol=1e-10)


def test_the_two_layouts_are_one_rotation_with_channels_renamed(ex):
    # Rotate-half on channels taken evens first, odds after = your interleaved RoPE, same order.
    x, positions = randn(5, 2, 8, seed=11), torch.tensor([0, 1, 2, 50, 7])
    order = evens_then_odds(8)
    got = tensor(ex.rope_interleaved(x, positions, 10000.0), "rope_interleaved")
    assert_close(got[..., order], rope_halves(x[..., order], positions, 10000.0),
                 describe("rope_interleaved", x=x, positions=positions, theta=10000.0)
                 + f"[..., {order.tolist()}] vs the page's rotate-half RoPE of x[..., "
                 f"{order.tolist()}] in float64", atol=1e-10, rtol=1e-10)


def test_rope_interleaved_odd_head_dim_raises(ex):
    x = randn(2, 1, 5, seed=12)
    expect_raises(ValueError, lambda: ex.rope_interleaved(x, torch.arange(2), 10000.0),
                  describe("rope_interleaved", x=x, positions=torch.arange(2), theta=10000.0)
                  + " with odd head_dim=5")


# ---- permute_to_halves ------------------------------------------------------------------------

def permute_hint(got_rows, num_rows, num_heads):
    """What a wrong row order resembles, when it is one of the common slips."""
    head_dim = num_rows // num_heads
    order = evens_then_odds(head_dim)
    inverse = torch.argsort(order)
    per_head = lambda within: [h * head_dim + int(i) for h in range(num_heads)  # noqa: E731
                               for i in within]
    if got_rows == per_head(inverse) and got_rows != per_head(order):
        return (" -- you moved the rows the other way (rotate-half to interleaved, llama.cpp's "
                "direction): which Meta row must land at row j of a head, and which at j + "
                "head_dim/2?")
    if num_heads > 1 and got_rows == evens_then_odds(num_rows).tolist():
        return (f" -- you reordered all {num_rows} rows as one head; reorder each head's "
                f"{head_dim} rows on their own")
    return ""


@pytest.mark.parametrize("num_rows, num_heads", [(8, 1), (12, 2), (4, 2)],
                         ids=["1-head-of-8", "2-heads-of-6", "2-heads-of-2"])
def test_permute_to_halves_by_hand(ex, num_rows, num_heads):
    # Row r of the weight holds the number r in each of its 3 columns, so the rows' order shows.
    head_dim = num_rows // num_heads
    weight = torch.arange(num_rows, dtype=torch.float32)[:, None].repeat(1, 3)
    what = (f"permute_to_halves(rows numbered 0..{num_rows - 1} [{num_rows}, 3], "
            f"num_heads={num_heads}; head_dim {head_dim})")
    got = tensor(ex.permute_to_halves(weight.clone(), num_heads), what)
    assert_equal(list(got.shape), [num_rows, 3], f"{what}: the shape")
    got_rows = [int(r) for r in got[:, 0].tolist()]
    expected = [h * head_dim + int(i) for h in range(num_heads) for i in evens_then_odds(head_dim)]
    if got_rows != expected:  # the wrong row named, not the whole answer printed
        wrong = next(j for j, (a, b) in enumerate(zip(got_rows, expected)) if a != b)
        raise AssertionError(
            f"{what}: the rows' order: you gave {got_rows}; row {wrong} is the first wrong one (row "
            f"{wrong % head_dim} of head {wrong // head_dim}): rows j and j + head_dim/2 of a head "
            f"must hold the pair of Meta rows that RoPE rotates together"
            f"{permute_hint(got_rows, num_rows, num_heads)}")


def test_permute_to_halves_is_written_not_borrowed(ex, monkeypatch):
    # kvlab's GGUF loader makes the same reorder (the grader compares with it below): calling it
    # passes every other check, and teaches nothing.
    import kvlab.gguf_loader

    imported = [name for name, value in vars(ex).items()
                if value is kvlab.gguf_loader.unpermute_rows]
    assert not imported, (f"your file imports kvlab.gguf_loader.unpermute_rows (as {imported[0]}): "
                          f"write the reorder yourself (read unpermute_rows when you are done)")

    def borrowed(*args, **kwargs):
        raise AssertionError("permute_to_halves(...) calls kvlab.gguf_loader.unpermute_rows: write "
                             "the reorder yourself (read unpermute_rows when you are done)")
    monkeypatch.setattr(kvlab.gguf_loader, "unpermute_rows", borrowed)
    weight = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 3)
    ex.permute_to_halves(weight, 1)


@pytest.mark.parametrize("num_heads, head_dim, hidden_size", [(4, 8, 20), (2, 16, 12), (1, 2, 5)],
                         ids=["q-4-heads", "k-2-heads", "1-head-of-2"])
def test_permute_to_halves_matches_kvlab_gguf_loader(ex, num_heads, head_dim, hidden_size):
    from kvlab.gguf_loader import unpermute_rows

    weight = randn(num_heads * head_dim, hidden_size, seed=13, dtype=torch.float32)
    original = weight.clone()
    what = describe("permute_to_halves", weight=weight, num_heads=num_heads)
    got = ex.permute_to_halves(weight, num_heads)
    assert_close(got, unpermute_rows(original, num_heads),
                 what + " vs kvlab.gguf_loader.unpermute_rows (rows reordered, values exact)",
                 atol=0, rtol=0)
    assert_close(weight, original, what + ": the weight passed in must stay as it was",
                 atol=0, rtol=0)


def test_q_k_scores_are_unchanged(ex):
    # GQA as in the tiny model: 4 query heads, 2 KV heads. Meta: interleaved RoPE on the original
    # weights; Hugging Face: rotate-half RoPE on the reordered ones. The scores must agree.
    heads, kv_heads, head_dim, hidden = 4, 2, 8, 24
    w_q, w_k = randn(heads * head_dim, hidden, seed=14), randn(kv_heads * head_dim, hidden, seed=15)
    h, positions = randn(6, hidden, seed=16), torch.tensor([0, 1, 2, 3, 40, 1000])

    def scores(q_weight, k_weight, rope):
        q = rope((h @ q_weight.T).view(6, heads, head_dim), positions, 10000.0)
        k = rope((h @ k_weight.T).view(6, kv_heads, head_dim), positions, 10000.0)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)  # [heads, 6, 6]

    what = ("q . k scores (4 query heads, 2 KV heads, head_dim 8, positions [0, 1, 2, 3, 40, "
            "1000]) with rotate-half RoPE on permute_to_halves(q_proj, 4), permute_to_halves("
            "k_proj, 2) vs interleaved RoPE on the original weights, float64")
    q_new = tensor(ex.permute_to_halves(w_q.clone(), heads), what)
    k_new = tensor(ex.permute_to_halves(w_k.clone(), kv_heads), what)
    for name, got, want in (("q_proj", q_new, w_q), ("k_proj", k_new, w_k)):
        assert_equal(list(got.shape), list(want.shape), f"{what}: the shape of {name}")
    assert_close(scores(q_new, k_new, rope_halves), scores(w_q, w_k, rope_complex), what,
                 atol=1e-10, rtol=1e-10)


def test_a_meta_layout_tiny_model_gives_the_same_logits(ex):
    # The tiny model's q_proj and k_proj rows put into Meta's order by the grader, then converted
    # back with your permute_to_halves: kvlab's (rotate-half) model must give the same logits.
    from kvlab.checkpoint import load_model

    model = load_model("tiny", dtype=torch.float32, device="cpu")
    config = model.config
    ids = torch.tensor([1, 5, 9, 200, 31, 7, 64, 2])
    with torch.no_grad():
        expected = model(ids)
        for number, layer in enumerate(model.model.layers):
            for name, heads in (("q_proj", config.num_attention_heads),
                                ("k_proj", config.num_key_value_heads)):
                proj = getattr(layer.self_attn, name)
                what = f"permute_to_halves(layer {number}'s {name} in Meta's order, {heads})"
                got = tensor(ex.permute_to_halves(to_meta_rows(proj.weight, heads), heads), what)
                assert_equal(list(got.shape), list(proj.weight.shape), f"{what}: the shape")
                proj.weight.copy_(got)
        got = model(ids)
    assert_close(got, expected,
                 f"the tiny model's logits on 8 tokens with every q_proj and k_proj put into "
                 f"Meta's order and back through permute_to_halves ({config.num_attention_heads} "
                 f"query heads, {config.num_key_value_heads} KV heads, head_dim "
                 f"{config.head_dim}) vs the model as it ships", atol=0, rtol=0)


@pytest.mark.parametrize("num_rows, num_heads, why", [(12, 5, "12 rows into 5 heads"),
                                                      (12, 4, "head_dim 3 is odd")],
                         ids=["rows-not-divisible", "odd-head-dim"])
def test_permute_to_halves_bad_shape_raises(ex, num_rows, num_heads, why):
    weight = randn(num_rows, 4, seed=17, dtype=torch.float32)
    expect_raises(ValueError, lambda: ex.permute_to_halves(weight, num_heads),
                  describe("permute_to_halves", weight=weight, num_heads=num_heads) + f": {why}")
