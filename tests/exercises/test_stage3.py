"""Stage 3: decode-time grouped-query attention vs SDPA over repeated K/V per request, weighted
pooling of KV heads vs `kvlab.gqa` and row selection.

Grades `stage3_grouped_query_attention.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it
with `kvlab check 3`. The tolerances are the precision of the dtype, not more: a float64 answer is
held to 1e-10, where a missing 1/sqrt(head_dim), a key too many or a head read by the wrong query
heads is off by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab import gqa
from kvlab.oracles import sdpa_attention
from kvlab.tools.grading import assert_close, expect_raises


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage3_grouped_query_attention.py")


def randn(*shape, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def decode_inputs(lens, heads, kv_heads, head_dim, max_model_len, dtype=torch.float64, seed=0,
                  leftover=float("nan")):
    """A batch of slabs whose slots past each request's length hold `leftover` (an earlier
    request's data: NaN by default)."""
    num_seqs = len(lens)
    query = randn(num_seqs, heads, head_dim, seed=seed, dtype=dtype)
    k_cache = randn(num_seqs, max_model_len, kv_heads, head_dim, seed=seed + 1, dtype=dtype)
    v_cache = randn(num_seqs, max_model_len, kv_heads, head_dim, seed=seed + 2, dtype=dtype)
    context_lens = torch.tensor(lens, dtype=torch.int64)
    for i, n in enumerate(lens):
        k_cache[i, n:] = leftover
        v_cache[i, n:] = leftover
    return query, k_cache, v_cache, context_lens


def reference(query, k_cache, v_cache, context_lens):
    """Each request on its own through SDPA over repeat_kv'd K/V, in float64: its new token at
    position n - 1 sees keys 0 .. n - 1."""
    rows = []
    for i, n in enumerate(context_lens.tolist()):
        rows.append(sdpa_attention(query[i:i + 1].double(), k_cache[i, :n].double(),
                                   v_cache[i, :n].double(), torch.tensor([n - 1]))[0])
    return torch.stack(rows).to(query.dtype)


def describe(query, k_cache, context_lens):
    dtype = str(query.dtype).replace("torch.", "")
    return (f"decode_attention(query {list(query.shape)} {dtype}, k_cache/v_cache "
            f"{list(k_cache.shape)}, context_lens={context_lens.tolist()})")


def hint(got, query, k_cache, v_cache, context_lens):
    """What a wrong answer resembles, when it is one of the common slips."""
    if not isinstance(got, torch.Tensor) or got.shape != query.shape or not got.isfinite().all():
        return ""
    heads, kv_heads = query.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    slips = [(" -- your output is attention without the 1/sqrt(head_dim) scale on the scores",
              lambda q, k, v, n: reference(q * math.sqrt(q.shape[-1]), k, v, n)),
             (" -- your output lets each request also read the slot after its last token (keys "
              "0 .. context_len; the new token is slot context_len - 1)",
              lambda q, k, v, n: reference(q, k, v, n + 1))]
    if 1 < group < heads:
        # Query heads grouped as [G, num_kv_heads]: head h reads KV head h % num_kv_heads (tiled
        # K/V), its output left in place or moved to where [num_kv_heads, G] would put it.
        tiled = lambda q, k, v, n: reference(q, k.repeat(1, 1, group, 1),  # noqa: E731
                                             v.repeat(1, 1, group, 1), n)
        moved = torch.arange(heads).view(group, kv_heads).T.reshape(-1)
        message = (" -- your output is attention with query head h reading KV head h % "
                   "num_key_value_heads (heads grouped as [G, num_kv_heads]); GQA has query head "
                   "h read KV head h // G: view the heads as [num_kv_heads, G]")
        slips += [(message, tiled), (message, lambda q, k, v, n: tiled(q, k, v, n)[:, moved])]
    for message, slip in slips:
        lens = context_lens
        if "slot after" in message and int(lens.max()) >= k_cache.shape[1]:
            continue
        clean_k = torch.nan_to_num(k_cache.double(), nan=0.0)
        clean_v = torch.nan_to_num(v_cache.double(), nan=0.0)
        expected = slip(query.double(), clean_k, clean_v, lens)
        if torch.allclose(got.double(), expected, atol=1e-5, rtol=1e-5):
            return message
    return ""


def check_decode(ex, inputs, atol, rtol, what_extra=""):
    query, k_cache, v_cache, context_lens = inputs
    expected = reference(*inputs)
    got = ex.decode_attention(query.clone(), k_cache.clone(), v_cache.clone(), context_lens.clone())
    what = (f"{describe(query, k_cache, context_lens)} [group size "
            f"{query.shape[1] // k_cache.shape[2]}{what_extra}] vs SDPA over repeat_kv'd K/V of "
            f"each request alone, float64 (kvlab.oracles.sdpa_attention)")
    try:
        assert_close(got, expected, what, atol=atol, rtol=rtol)
    except AssertionError as error:
        raise AssertionError(f"{error}{hint(got, *inputs)}") from None


# ---- decode_attention -------------------------------------------------------------------------

CASES = [  # context_lens, query heads, KV heads, head_dim, max_model_len
    ([3, 7, 1], 4, 4, 8, 8),      # MHA, G = 1
    ([5, 2], 8, 2, 16, 6),        # G = 4 (the tiny model's grouping)
    ([4, 6, 1, 2], 6, 2, 4, 6),   # G = 3, not a power of two
    ([7, 3], 8, 1, 8, 7),         # MQA; the first request fills its slab
    ([1], 4, 2, 8, 4),            # one token: it sees only itself
]
CASE_IDS = ["MHA", "G4", "G3", "MQA", "one-token"]


@pytest.mark.parametrize("lens, heads, kv_heads, head_dim, max_model_len", CASES, ids=CASE_IDS)
def test_decode_attention_matches_sdpa_float64(ex, lens, heads, kv_heads, head_dim, max_model_len):
    inputs = decode_inputs(lens, heads, kv_heads, head_dim, max_model_len, leftover=0.0)
    check_decode(ex, inputs, atol=1e-10, rtol=1e-10, what_extra=", unused slots 0")


def test_decode_attention_float32(ex):
    inputs = decode_inputs([9, 4, 12], 8, 2, 32, 12, dtype=torch.float32, seed=5, leftover=0.0)
    check_decode(ex, inputs, atol=1e-5, rtol=1e-5, what_extra=", float32, unused slots 0")


@pytest.mark.parametrize("leftover", [float("nan"), float("inf"), 1e4],
                         ids=["nan", "inf", "large"])
def test_decode_attention_ignores_leftover_slots(ex, leftover):
    inputs = decode_inputs([2, 5, 3], 6, 3, 8, 6, seed=9, leftover=leftover)
    check_decode(ex, inputs, atol=1e-10, rtol=1e-10,
                 what_extra=f", unused slots hold {leftover:g}, an earlier request's: mask the "
                            f"scores and zero the values (0 x NaN is NaN)")


def test_decode_attention_each_request_reads_only_its_slab(ex):
    query, k_cache, v_cache, lens = decode_inputs([4, 4], 4, 2, 8, 4, seed=3, leftover=0.0)
    first = ex.decode_attention(query, k_cache, v_cache, lens)
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2[1], v2[1] = 7.0, -7.0  # change only request 1's slab
    second = ex.decode_attention(query, k2, v2, lens)
    what = (f"{describe(query, k_cache, lens)}: request 0's output after changing only request "
            f"1's slab vs before")
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor), (
        f"{what}: expected tensors, got {type(first).__name__}")
    assert_close(second[:1], first[:1], what, atol=1e-12, rtol=1e-12)


COPIES = [  # (owner, name, label): ways to copy K/V once per query head
    (torch.Tensor, "repeat_interleave", "Tensor.repeat_interleave"),
    (torch, "repeat_interleave", "torch.repeat_interleave"),
    (torch.Tensor, "repeat", "Tensor.repeat"),
    (torch.Tensor, "tile", "Tensor.tile"),
    (torch, "tile", "torch.tile"),
]
VIEWS = [(torch.Tensor, "expand", "Tensor.expand"), (torch.Tensor, "expand_as", "Tensor.expand_as")]


def test_decode_attention_does_not_repeat_kv(ex, monkeypatch):
    inputs = decode_inputs([3, 6], 8, 2, 8, 6, seed=4, leftover=0.0)
    query, k_cache, v_cache, lens = inputs
    kv_storages = {k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()}
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
        got = ex.decode_attention(query, k_cache, v_cache, lens)
    what = f"{describe(query, k_cache, lens)} [group size 4]"
    assert not calls, (
        f"{what} called {', '.join(sorted(set(calls)))}: that copies K/V once per query head, "
        f"the memory GQA saves. View the query heads as [num_kv_heads, G, head_dim] instead")
    assert_close(got, reference(*inputs), what + " vs kvlab.oracles.sdpa_attention",
                 atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("lens, heads, kv_heads", [([2], 6, 4), ([0, 2], 4, 2), ([2, 5], 4, 2)],
                         ids=["6-over-4-heads", "length-0", "length-past-max_model_len"])
def test_decode_attention_rejects(ex, lens, heads, kv_heads):
    query, k_cache, v_cache, _ = decode_inputs([1] * len(lens), heads, kv_heads, 8, 4)
    context_lens = torch.tensor(lens)
    expect_raises(ValueError, lambda: ex.decode_attention(query, k_cache, v_cache, context_lens),
                  f"{describe(query, k_cache, context_lens)} [max_model_len 4, {heads} query heads "
                  f"over {kv_heads} KV heads]")


# ---- pool_kv_heads ----------------------------------------------------------------------------

def pooling_hint(got, weight, heads, head_dim, new_heads, mix):
    """A note when `got` pooled heads j, j + new, j + 2 new, ... (strided, not adjacent)."""
    if not isinstance(got, torch.Tensor) or heads == new_heads or new_heads == 1:
        return ""
    strided = torch.einsum("p,pjdh->jdh", mix.double(),
                           weight.double().view(heads // new_heads, new_heads, head_dim, -1))
    if got.shape == strided.reshape(new_heads * head_dim, -1).shape and torch.allclose(
            got.double(), strided.reshape(new_heads * head_dim, -1), atol=1e-6):
        return (" -- you pooled heads j, j + new, j + 2*new, ...; GQA pools the adjacent "
                "heads j*P .. j*P + P - 1 (the ones whose query heads new head j serves)")
    return ""


def pool_what(weight, heads, head_dim, new_heads, mix, against):
    dtype = str(weight.dtype).replace("torch.", "")
    return (f"pool_kv_heads(weight {list(weight.shape)} {dtype}, num_kv_heads={heads}, "
            f"head_dim={head_dim}, new_num_kv_heads={new_heads}, mix={mix.tolist()}) vs {against}")


def check_pool(ex, weight, heads, head_dim, new_heads, mix, expected, against, atol=1e-12):
    got = ex.pool_kv_heads(weight.clone(), heads, head_dim, new_heads, mix.clone())
    what = pool_what(weight, heads, head_dim, new_heads, mix, against)
    try:
        assert_close(got, expected, what, atol=atol, rtol=atol)
    except AssertionError as error:
        raise AssertionError(f"{error}{pooling_hint(got, weight, heads, head_dim, new_heads, mix)}"
                             ) from None


SHAPES = [(8, 4, 4, 6), (8, 2, 4, 6), (8, 1, 4, 6), (6, 2, 3, 5), (4, 4, 2, 3)]
SHAPE_IDS = ["8-to-4", "8-to-2", "8-to-MQA", "6-to-2 (P=3)", "4-to-4 (unchanged)"]


@pytest.mark.parametrize("heads, new_heads, head_dim, hidden", SHAPES, ids=SHAPE_IDS)
def test_uniform_mix_is_mean_pooling(ex, heads, new_heads, head_dim, hidden):
    weight = randn(heads * head_dim, hidden, seed=heads + new_heads)
    mix = torch.full((heads // new_heads,), 1 / (heads // new_heads), dtype=torch.float64)
    check_pool(ex, weight, heads, head_dim, new_heads, mix,
               gqa.mean_pool_kv_heads(weight, heads, head_dim, new_heads),
               "kvlab.gqa.mean_pool_kv_heads (uniform weights are the paper's mean-pooling)")


@pytest.mark.parametrize("keep", [0, 3])
def test_one_hot_mix_keeps_one_head_per_group(ex, keep):
    heads, new_heads, head_dim, hidden = 8, 2, 4, 6
    weight = randn(heads * head_dim, hidden, seed=keep + 20)
    mix = torch.zeros(4, dtype=torch.float64)
    mix[keep] = 1.0
    kept = [group * 4 + keep for group in range(new_heads)]  # old heads kept, one per group
    rows = torch.cat([torch.arange(head * head_dim, (head + 1) * head_dim) for head in kept])
    check_pool(ex, weight, heads, head_dim, new_heads, mix, weight[rows],
               f"the rows of old heads {kept} (one-hot weights keep head {keep} of each group)")


def test_any_mix_is_a_weighted_sum(ex):
    heads, new_heads, head_dim, hidden = 6, 2, 3, 4
    weight = randn(heads * head_dim, hidden, seed=31)
    mix = torch.tensor([0.5, -0.25, 2.0], dtype=torch.float64)
    expected = torch.zeros(new_heads * head_dim, hidden, dtype=torch.float64)
    for j in range(new_heads):
        for p in range(3):
            old = j * 3 + p
            expected[j * head_dim:(j + 1) * head_dim] += \
                mix[p] * weight[old * head_dim:(old + 1) * head_dim]
    check_pool(ex, weight, heads, head_dim, new_heads, mix, expected,
               "sum over p of mix[p] x old head (j*3 + p), written as a loop")


def test_pool_kv_heads_keeps_the_weight_dtype(ex):
    weight = randn(8 * 4, 6, seed=11, dtype=torch.float32)
    mix = torch.full((4,), 0.25, dtype=torch.float64)
    check_pool(ex, weight, 8, 4, 2, mix, gqa.mean_pool_kv_heads(weight, 8, 4, 2),
               "kvlab.gqa.mean_pool_kv_heads, in the weight's dtype (float32)", atol=1e-6)


@pytest.mark.parametrize("new_heads, mix_len", [(3, 3), (0, 1), (2, 3)],
                         ids=["3-does-not-divide-8", "no-heads", "3-weights-for-groups-of-4"])
def test_pool_kv_heads_rejects(ex, new_heads, mix_len):
    weight = randn(8 * 4, 6)
    mix = torch.ones(mix_len, dtype=torch.float64) / mix_len
    expect_raises(ValueError, lambda: ex.pool_kv_heads(weight, 8, 4, new_heads, mix),
                  f"pool_kv_heads(weight [32, 6], num_kv_heads=8, head_dim=4, "
                  f"new_num_kv_heads={new_heads}, mix of {mix_len} weights)")
