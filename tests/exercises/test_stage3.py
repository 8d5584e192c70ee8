"""Stage 3: decode-time grouped-query attention vs SDPA over repeated K/V per request; MHA -> GQA
with any grouping of heads vs `kvlab.gqa` on adjacent groups, vs the original model's logits (a
grouping that only moves heads), and vs heads the grader moved itself before mean-pooling them.

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
from kvlab.config import LlamaConfig
from kvlab.model import LlamaForCausalLM
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


# ---- pool_groups ------------------------------------------------------------------------------

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def mha_layer(heads, head_dim, hidden, seed=0, dtype=torch.float64):
    """One MHA layer's nn.Linear weights: q/k/v [heads*head_dim, hidden], o [hidden, ...]."""
    return {part: randn(*((hidden, heads * head_dim) if part == "o_proj"
                          else (heads * head_dim, hidden)), seed=seed + i, dtype=dtype)
            for i, part in enumerate(PARTS)}


def moved_by_hand(layer, order, head_dim):
    """The grader's own reordering: head by head, in a loop (rows of q/k/v, columns of o)."""
    rows = lambda w: torch.cat([w[h * head_dim:(h + 1) * head_dim] for h in order])  # noqa: E731
    return {"q_proj": rows(layer["q_proj"]), "k_proj": rows(layer["k_proj"]),
            "v_proj": rows(layer["v_proj"]),
            "o_proj": torch.cat([layer["o_proj"][:, h * head_dim:(h + 1) * head_dim]
                                 for h in order], dim=1)}


def expected_layer(layer, groups, head_dim):
    """Heads moved by hand, then the library's mean-pooling of adjacent heads."""
    heads = len(layer["k_proj"]) // head_dim
    moved = moved_by_hand(layer, [h for group in groups for h in group], head_dim)
    return {**moved, **{part: gqa.mean_pool_kv_heads(moved[part], heads, head_dim, len(groups))
                        for part in ("k_proj", "v_proj")}}


def groups_hint(got, layer, groups, head_dim):
    """What a wrong conversion resembles, when it is one of the common slips."""
    if not isinstance(got, dict) or sorted(got) != sorted(PARTS):
        return ""
    order = [h for group in groups for h in group]
    moved = moved_by_hand(layer, order, head_dim)

    def same(part, tensor):
        return (isinstance(got[part], torch.Tensor) and got[part].shape == tensor.shape
                and torch.allclose(got[part].double(), tensor.double(), atol=1e-9))
    if order != sorted(order) and same("q_proj", moved["q_proj"]) and same("o_proj",
                                                                           layer["o_proj"]):
        return (" -- your q_proj's heads moved but o_proj's columns did not: each query head's "
                "output must still meet its own columns of o_proj (move them with it)")
    if order != sorted(order) and same("q_proj", layer["q_proj"]):
        return (" -- your q_proj is the old one: a group's query heads must become adjacent "
                "(query heads j*P .. j*P + P - 1 read new KV head j), so move their rows")
    size = len(order) // len(groups)
    expected = expected_layer(layer, groups, head_dim)
    if size > 1 and same("k_proj", size * expected["k_proj"]):
        return " -- your K/V heads are each group's sum; pooling takes the mean"
    square = layer["o_proj"].shape[0] == layer["o_proj"].shape[1]
    if square and same("o_proj", moved_by_hand({**layer, "q_proj": layer["o_proj"]}, order,
                                               head_dim)["q_proj"]):
        return (" -- you moved o_proj's rows; its columns are the heads' (o_proj is [hidden, "
                "num_heads*head_dim])")
    return ""


def check_groups(ex, layer, groups, head_dim, against, expected=None, atol=1e-12):
    expected = expected or expected_layer(layer, groups, head_dim)
    got = ex.pool_groups({part: w.clone() for part, w in layer.items()}, groups, head_dim)
    dtype = str(layer["q_proj"].dtype).replace("torch.", "")
    what = (f"pool_groups(an MHA layer of {len(layer['k_proj']) // head_dim} heads, head_dim "
            f"{head_dim}, hidden {layer['q_proj'].shape[1]}, {dtype}; groups={groups})")
    if not isinstance(got, dict) or sorted(got) != sorted(PARTS):
        raise AssertionError(f"{what}: expected a dict with the keys {list(PARTS)}, got "
                             f"{type(got).__name__} {sorted(got) if isinstance(got, dict) else ''}")
    try:
        for part in PARTS:
            assert_close(got[part], expected[part], f"{what}[{part!r}] vs {against}",
                         atol=atol, rtol=atol)
    except AssertionError as error:
        raise AssertionError(f"{error}{groups_hint(got, layer, groups, head_dim)}") from None


@pytest.mark.parametrize("heads, groups", [
    (8, [[0, 1, 2, 3], [4, 5, 6, 7]]), (8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (6, [[0, 1, 2], [3, 4, 5]]), (4, [[0, 1, 2, 3]])], ids=["8-to-2", "8-to-4", "6-to-2", "MQA"])
def test_adjacent_groups_are_mean_pooling(ex, heads, groups):
    layer = mha_layer(heads, 4, 6, seed=heads + len(groups))
    expected = {**layer, **{part: gqa.mean_pool_kv_heads(layer[part], heads, 4, len(groups))
                            for part in ("k_proj", "v_proj")}}
    check_groups(ex, layer, groups, 4, "kvlab.gqa.mean_pool_kv_heads; q_proj and o_proj as "
                 "they were (adjacent groups: the notebook's conversion)", expected)


@pytest.mark.parametrize("heads, groups", [
    (8, [[5, 0, 2, 7], [3, 1, 6, 4]]), (6, [[4, 1], [0, 5], [3, 2]]),
    (6, [(2, 0, 4), (5, 3, 1)]), (8, [[1, 2, 3, 4, 5, 6, 7, 0]])],
    ids=["8-to-2", "6-to-3", "tuples", "MQA-reordered"])
def test_any_groups_are_the_moved_heads_mean_pooled(ex, heads, groups):
    layer = mha_layer(heads, 4, heads * 4, seed=7 + heads)  # square o_proj: moving rows runs too
    check_groups(ex, layer, groups, 4, "the old heads moved head by head, in the order the "
                 "groups list them, then kvlab.gqa.mean_pool_kv_heads of adjacent heads")


def small_mha(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def convert(ex, model, kv_heads, groups_of_layer):
    return gqa.convert_layers(model, kv_heads, lambda index, weights: ex.pool_groups(
        weights, groups_of_layer[index], model.config.head_dim))


def test_groups_of_one_head_only_move_heads(ex):
    model = small_mha()
    groups = [[[2], [0], [3], [1]], [[3], [2], [1], [0]]]  # per layer: heads moved, none pooled
    ids = torch.randint(0, 53, (17,), generator=torch.Generator().manual_seed(1))
    what = (f"a 2-layer MHA model (4 heads of 8, float64) through pool_groups with groups of one "
            f"head each, {groups[0]} in layer 0 and {groups[1]} in layer 1 (heads reordered, "
            f"none pooled): logits vs the original model's")
    got = convert(ex, model, 4, groups)(ids)
    try:
        assert_close(got, model(ids), what, atol=1e-10, rtol=1e-10)
    except AssertionError as error:
        layer = {part: getattr(model.model.layers[0].self_attn, part).weight.detach()
                 for part in PARTS}
        hint = groups_hint(ex.pool_groups(layer, groups[0], 8), layer, groups[0], 8)
        raise AssertionError(f"{error}{hint}") from None


def test_a_regrouped_model_matches_heads_moved_then_pooled(ex):
    model = small_mha(seed=3)
    groups = [[[3, 0], [1, 2]], [[1, 3], [2, 0]]]
    ids = torch.randint(0, 53, (21,), generator=torch.Generator().manual_seed(2))
    reference = gqa.convert_layers(model, 2, lambda index, weights: expected_layer(
        weights, groups[index], 8))
    what = (f"a 2-layer MHA model (4 heads of 8, float64) converted to 2 KV heads through "
            f"pool_groups, groups {groups[0]} in layer 0 and {groups[1]} in layer 1: logits vs the "
            f"same model with its heads moved by the grader, then mean-pooled")
    assert_close(convert(ex, model, 2, groups)(ids), reference(ids), what, atol=1e-10, rtol=1e-10)


def test_pool_groups_keeps_the_weights_dtype(ex):
    layer = mha_layer(4, 4, 6, seed=11, dtype=torch.float32)
    check_groups(ex, layer, [[1, 3], [0, 2]], 4, "the moved heads, mean-pooled, in float32",
                 atol=1e-6)


@pytest.mark.parametrize("groups", [[[0, 1], [1, 2]], [[0, 1, 2], [3]], [[0, 1], [2, 4]],
                                    [[0, 1]]],
                         ids=["head-repeated", "sizes-differ", "head-out-of-range", "head-missing"])
def test_pool_groups_rejects_groups_that_are_not_a_partition(ex, groups):
    layer = mha_layer(4, 4, 6)
    expect_raises(ValueError, lambda: ex.pool_groups(layer, groups, 4),
                  f"pool_groups(an MHA layer of 4 heads, head_dim 4; groups={groups})")


def test_pool_groups_rejects_a_layer_that_is_not_mha(ex):
    layer = mha_layer(4, 4, 6)
    layer["k_proj"], layer["v_proj"] = layer["k_proj"][:8], layer["v_proj"][:8]  # 2 KV heads
    expect_raises(ValueError, lambda: ex.pool_groups(layer, [[0, 1], [2, 3]], 4),
                  "pool_groups(a GQA layer: q_proj [16, 6], k_proj [8, 6]; groups=[[0, 1], "
                  "[2, 3]]) [it converts MHA, as many KV heads as query heads]")
