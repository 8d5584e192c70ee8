"""Stage 3: grouped-query attention vs SDPA over repeated K/V, mean-pooling vs `kvlab.gqa`.

Grades `stage3_grouped_query_attention.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it
with `kvlab check 3`.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import gqa, sizing
from kvlab.attention import repeat_kv
from kvlab.oracles import sdpa_attention
from kvlab.config import PRESETS
from kvlab.tools.grading import assert_close, assert_equal, expect_raises


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage3_grouped_query_attention.py")


def randn(*shape, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def qkv(tokens, heads, kv_heads, head_dim, dtype=torch.float64, seed=0):
    return (randn(tokens, heads, head_dim, seed=seed, dtype=dtype),
            randn(tokens, kv_heads, head_dim, seed=seed + 1, dtype=dtype),
            randn(tokens, kv_heads, head_dim, seed=seed + 2, dtype=dtype))


def shapes(q, k, v):
    dtype = str(q.dtype).replace("torch.", "")
    return f"q {list(q.shape)} {dtype}, k {list(k.shape)}, v {list(v.shape)}"


# ---- kv_head_for_query_head -------------------------------------------------------------------

@pytest.mark.parametrize("h, heads, kv_heads, expected, model", [
    (0, 32, 8, 0, "llama-3.1-8b, G=4"),
    (3, 32, 8, 0, "llama-3.1-8b, G=4"),
    (4, 32, 8, 1, "llama-3.1-8b, G=4"),
    (31, 32, 8, 7, "llama-3.1-8b, G=4"),
    (13, 28, 4, 1, "qwen2.5-7b, G=7"),
    (5, 9, 3, 1, "smollm2-135m, G=3"),
    (17, 32, 32, 17, "MHA, G=1"),
    (63, 64, 1, 0, "MQA, one KV head"),
])
def test_kv_head_for_query_head(ex, h, heads, kv_heads, expected, model):
    assert_equal(ex.kv_head_for_query_head(h, heads, kv_heads), expected,
                 f"kv_head_for_query_head(h={h}, num_attention_heads={heads}, "
                 f"num_key_value_heads={kv_heads}) [{model}]")


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (6, 2), (4, 1)])
def test_kv_head_for_query_head_is_what_repeat_kv_does(ex, heads, kv_heads):
    # KV head j filled with the value j: after repeat_kv, query head h sees the KV head it reads.
    k = torch.arange(kv_heads, dtype=torch.float64).view(1, kv_heads, 1)
    repeated = repeat_kv(k, heads // kv_heads)
    expected = [int(repeated[0, h, 0]) for h in range(heads)]
    got = [ex.kv_head_for_query_head(h, heads, kv_heads) for h in range(heads)]
    assert got == expected, (
        f"[kv_head_for_query_head(h, {heads}, {kv_heads}) for h in range({heads})]: expected "
        f"{expected} (the KV head repeat_kv gives query head h), got {got}")


@pytest.mark.parametrize("h, heads, kv_heads", [(0, 32, 5), (0, 32, 0), (32, 32, 8), (-1, 32, 8)],
                         ids=["5-does-not-divide-32", "no-kv-heads", "h-too-big", "h-negative"])
def test_kv_head_for_query_head_rejects(ex, h, heads, kv_heads):
    what = (f"kv_head_for_query_head(h={h}, num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads})")
    error = expect_raises(ValueError, lambda: ex.kv_head_for_query_head(h, heads, kv_heads), what)
    if kv_heads == 5:
        assert "32" in str(error) and "5" in str(error), (
            f"{what}: the ValueError message should name both head counts (32 and 5); got "
            f"{str(error)!r}")


# ---- grouped_attention ------------------------------------------------------------------------

CASES = [  # tokens, query heads, KV heads, head_dim
    (5, 4, 4, 8),   # MHA, G = 1
    (6, 4, 2, 8),   # G = 2
    (7, 6, 2, 4),   # G = 3, not a power of two
    (5, 8, 1, 8),   # MQA
    (1, 4, 2, 8),   # one token: sees only itself
]
CASE_IDS = ["MHA", "G2", "G3", "MQA", "one-token"]


def mapping_hint(got, q, k, v):
    """A note when `got` is attention with query head h reading KV head h % Hkv (a common slip)."""
    group = q.shape[1] // k.shape[1]
    if group == 1 or k.shape[1] == 1 or not isinstance(got, torch.Tensor):
        return ""
    tiled = sdpa_attention(q.double(), k.double().repeat(1, group, 1),
                                v.double().repeat(1, group, 1), torch.arange(q.shape[0]))
    if got.shape == tiled.shape and torch.allclose(got.double(), tiled, atol=1e-5):
        return (" -- your output is attention with query head h reading KV head h % "
                "num_key_value_heads; GQA has it read KV head h // group")
    return ""


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", CASES, ids=CASE_IDS)
def test_grouped_attention_matches_sdpa_float64(ex, tokens, heads, kv_heads, head_dim):
    q, k, v = qkv(tokens, heads, kv_heads, head_dim)
    expected = sdpa_attention(q, k, v, torch.arange(tokens))
    got = ex.grouped_attention(q, k, v)
    what = (f"grouped_attention({shapes(q, k, v)}) [group size {heads // kv_heads}] vs SDPA over "
            f"repeat_kv'd K/V with a causal mask (kvlab.oracles.sdpa_attention)")
    try:
        assert_close(got, expected, what, atol=1e-10, rtol=1e-10)
    except AssertionError as error:
        raise AssertionError(f"{error}{mapping_hint(got, q, k, v)}") from None


def test_grouped_attention_float32(ex):
    q, k, v = qkv(9, 6, 3, 16, dtype=torch.float32, seed=5)
    expected = sdpa_attention(q.double(), k.double(), v.double(), torch.arange(9)).float()
    got = ex.grouped_attention(q, k, v)
    what = f"grouped_attention({shapes(q, k, v)}) vs SDPA in float64 (result in float32)"
    try:
        assert_close(got, expected, what, atol=1e-5, rtol=1e-5)
    except AssertionError as error:
        raise AssertionError(f"{error}{mapping_hint(got, q, k, v)}") from None


def test_grouped_attention_is_causal(ex):
    q, k, v = qkv(6, 4, 2, 8, seed=7)
    first = ex.grouped_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = 100.0, -100.0  # change only the keys/values of tokens 4 and 5
    second = ex.grouped_attention(q, k2, v2)
    what = (f"grouped_attention({shapes(q, k, v)}): tokens 0-3 must not see the keys/values of "
            f"tokens 4-5; out[:4] after changing k[4:], v[4:] vs out[:4] before")
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor), (
        f"{what}: expected tensors, got {type(first).__name__}")
    assert_close(second[:4], first[:4], what, atol=1e-12, rtol=1e-12)


COPIES = [  # (owner, name, label): ways to copy K/V once per query head
    (torch.Tensor, "repeat_interleave", "Tensor.repeat_interleave"),
    (torch, "repeat_interleave", "torch.repeat_interleave"),
    (torch.Tensor, "repeat", "Tensor.repeat"),
    (torch.Tensor, "tile", "Tensor.tile"),
    (torch, "tile", "torch.tile"),
]
VIEWS = [(torch.Tensor, "expand", "Tensor.expand"), (torch.Tensor, "expand_as", "Tensor.expand_as")]


def test_grouped_attention_does_not_repeat_kv(ex, monkeypatch):
    q, k, v = qkv(6, 8, 2, 8, seed=3)
    kv_storages = {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
    calls = []

    def watch(patch, owner, name, label, only_kv):
        original = getattr(owner, name)

        def watched(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("input")
            on_kv = (isinstance(tensor, torch.Tensor)
                     and tensor.untyped_storage().data_ptr() in kv_storages)
            if on_kv or not only_kv:
                calls.append(label)
            return original(*args, **kwargs)
        patch.setattr(owner, name, watched)

    import kvlab.attention
    with monkeypatch.context() as patch:  # every patch is undone when the block ends
        for owner, name, label in COPIES:
            watch(patch, owner, name, label, only_kv=False)
        for owner, name, label in VIEWS:  # expanding a mask is fine; expanding K/V is not
            watch(patch, owner, name, label, only_kv=True)
        watch(patch, kvlab.attention, "repeat_kv", "kvlab.attention.repeat_kv", only_kv=False)
        if callable(getattr(ex, "repeat_kv", None)):
            watch(patch, ex, "repeat_kv", "repeat_kv", only_kv=False)
        got = ex.grouped_attention(q, k, v)
    what = f"grouped_attention({shapes(q, k, v)}) [group size 4]"
    assert not calls, (
        f"{what} called {', '.join(sorted(set(calls)))}: that copies K/V once per query head, "
        f"the memory GQA saves. Reshape the query heads into [Hkv, G * T, D] instead")
    assert_close(got, sdpa_attention(q, k, v, torch.arange(6)),
                 what + " vs kvlab.oracles.sdpa_attention", atol=1e-10, rtol=1e-10)


def test_grouped_attention_rejects_uneven_groups(ex):
    q, k, v = qkv(4, 6, 4, 8)
    expect_raises(ValueError, lambda: ex.grouped_attention(q, k, v),
                  f"grouped_attention({shapes(q, k, v)}) [6 query heads over 4 KV heads]")


# ---- mean_pool_kv_heads -----------------------------------------------------------------------

def pooling_hint(got, weight, heads, head_dim, new_heads):
    """A note when `got` pooled heads j, j + new, j + 2 new, ... (strided, not adjacent)."""
    if not isinstance(got, torch.Tensor) or heads == new_heads or new_heads == 1:
        return ""
    strided = weight.view(heads // new_heads, new_heads, head_dim, -1).mean(0).reshape(
        new_heads * head_dim, -1)
    if got.shape == strided.shape and torch.allclose(got.double(), strided.double(), atol=1e-6):
        return (" -- you averaged heads j, j + new, j + 2*new, ...; GQA averages the adjacent "
                "heads j*P .. j*P + P - 1 (the ones whose query heads new head j serves)")
    return ""


@pytest.mark.parametrize("heads, new_heads, head_dim, hidden", [
    (8, 4, 4, 6), (8, 2, 4, 6), (8, 1, 4, 6), (6, 2, 3, 5), (4, 4, 2, 3)],
    ids=["8-to-4", "8-to-2", "8-to-MQA", "6-to-2 (P=3)", "4-to-4 (unchanged)"])
def test_mean_pool_kv_heads_matches_kvlab(ex, heads, new_heads, head_dim, hidden):
    weight = randn(heads * head_dim, hidden, seed=heads + new_heads)
    expected = gqa.mean_pool_kv_heads(weight, heads, head_dim, new_heads)
    got = ex.mean_pool_kv_heads(weight.clone(), heads, head_dim, new_heads)
    what = (f"mean_pool_kv_heads(weight [{heads * head_dim}, {hidden}] float64, num_kv_heads="
            f"{heads}, head_dim={head_dim}, new_num_kv_heads={new_heads}) vs "
            f"kvlab.gqa.mean_pool_kv_heads")
    try:
        assert_close(got, expected, what, atol=1e-12, rtol=1e-12)
    except AssertionError as error:
        raise AssertionError(f"{error}{pooling_hint(got, weight, heads, head_dim, new_heads)}") \
            from None


def test_mean_pool_kv_heads_keeps_dtype(ex):
    weight = randn(8 * 4, 6, seed=11, dtype=torch.float32)
    assert_close(ex.mean_pool_kv_heads(weight, 8, 4, 2), gqa.mean_pool_kv_heads(weight, 8, 4, 2),
                 "mean_pool_kv_heads(weight [32, 6] float32, num_kv_heads=8, head_dim=4, "
                 "new_num_kv_heads=2) vs kvlab.gqa.mean_pool_kv_heads", atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("new_heads", [3, 0])
def test_mean_pool_kv_heads_rejects(ex, new_heads):
    weight = randn(8 * 4, 6)
    expect_raises(ValueError, lambda: ex.mean_pool_kv_heads(weight, 8, 4, new_heads),
                  f"mean_pool_kv_heads(weight [32, 6], num_kv_heads=8, head_dim=4, "
                  f"new_num_kv_heads={new_heads})")


# ---- kv_cache_saving --------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_kv_cache_saving_matches_sizing(ex, name):
    config = PRESETS[name]
    mha = config.with_changes(num_key_value_heads=config.num_attention_heads)
    expected = sizing.kv_bytes_per_token(mha) / sizing.kv_bytes_per_token(config)
    got = ex.kv_cache_saving(config.num_attention_heads, config.num_key_value_heads)
    what = (f"kv_cache_saving(num_attention_heads={config.num_attention_heads}, "
            f"num_key_value_heads={config.num_key_value_heads}) [{name}: MHA KV bytes per token / "
            f"its KV bytes per token, from kvlab.sizing]")
    assert isinstance(got, (int, float)) and not isinstance(got, bool) and \
        abs(got - expected) < 1e-12, f"{what}: expected {expected:g}, got {got!r}"


@pytest.mark.parametrize("heads, kv_heads", [(32, 5), (32, 0)])
def test_kv_cache_saving_rejects(ex, heads, kv_heads):
    expect_raises(ValueError, lambda: ex.kv_cache_saving(heads, kv_heads),
                  f"kv_cache_saving(num_attention_heads={heads}, num_key_value_heads={kv_heads})")
