"""The stage-5 Triton kernels against a float64 reference, on the CPU interpreter (small sizes).

Every decode case: fresh random inputs (seeded per case), ragged lengths, a shuffled non-contiguous
block table, sequences of length 1 and of lengths = 0 and 1 (mod block_size), a padded block table
whose padding entries point at a block full of NaN, unowned slots at the end of last blocks and
unowned blocks filled with NaN / Inf (the pool is "poisoned": only what a sequence owns may reach
its output), and an output buffer filled with NaN before the launch (so every element must be
written). Each case runs without split and with split-KV, tile 16 so the online softmax rescales
across several tiles. Tolerances: float32 1e-5, float16 2e-3, bfloat16 2e-2 (relative to the
largest output magnitude of the case).

Random scores near N(0, 1) hide mistakes in the running max: exp2 of them never overflows, and the
max may never grow after the first tile. So more cases have scores up to about 1000 whose max grows
late, in a sequence spanning dozens of blocks and several splits (`LARGE_SCORE_CASES`).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from kvlab.kernels.pool_layout import HEAD_MAJOR, TOKEN_MAJOR
from kvlab.kernels.split_kv import (MAX_SPLITS, MIN_TOKENS_PER_SPLIT, PROGRAMS_PER_SM,
                                    choose_num_splits, resident_programs, tokens_per_split)
from kvlab.oracles import sdpa_attention

pa = pytest.importorskip("kvlab.kernels.paged_attention")  # needs Triton
from kvlab.kernels.write_kv import write_kv  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
# TRITON_INTERPRET=1); on a machine with one, the same tests run compiled, on the GPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def scatter_case(seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, large=False):
    """A poisoned token-major pool holding `seq_lens` sequences in shuffled blocks.

    `large`: integer queries in -16..16 and keys in -16..16 times 1, 2, 3, 4 along each sequence
    (by quarters), so scores reach about 1000 and their max grows late. Integers this small are
    exact in every dtype here, and their dot products in float32.

    Returns (query, k_pool, v_pool, block_tables int32, seq_lens int32, tables as lists).
    """
    gen = torch.Generator().manual_seed(seed)
    owned_blocks = sum(-(-n // block_size) for n in seq_lens)
    num_blocks = owned_blocks + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = (torch.randint(-16, 17, shape, generator=gen) if large
              else torch.randn(shape, generator=gen)).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(free[:count])
        free = free[count:]
        if large:
            positions = torch.arange(seq_len)
            growth = (1 + 4 * positions // seq_len).to(dtype)[:, None, None]
            blocks = torch.tensor(tables[-1])[positions // block_size]
            k_pool[blocks, positions % block_size] *= growth
        tail = seq_len % block_size  # the unused end of the last block is not this sequence's
        if tail:
            k_pool[tables[-1][-1], tail:] = float("nan")
            v_pool[tables[-1][-1], tail:] = float("inf")
    nan_block, inf_block = free
    k_pool[nan_block], v_pool[nan_block] = float("nan"), float("nan")
    k_pool[inf_block], v_pool[inf_block] = float("inf"), float("-inf")
    width = max(len(t) for t in tables) + 1  # at least one padding entry for every sequence
    padded = [t + [nan_block if i % 2 else inf_block] * (width - len(t))
              for i, t in enumerate(tables)]
    query_shape = (len(seq_lens), num_kv_heads * group, head_dim)
    query = (torch.randint(-16, 17, query_shape, generator=gen) if large
             else torch.randn(query_shape, generator=gen)).to(dtype)
    return (query, k_pool, v_pool, torch.tensor(padded, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), tables)


def reference_decode(query, k_pool, v_pool, tables, seq_lens, block_size):
    """Float64 attention (PyTorch SDPA, `kvlab.oracles`) of each sequence's query over its own
    tokens (token-major pool)."""
    outputs = []
    for i, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        blocks = torch.tensor(tables[i])[positions // block_size]
        keys = k_pool[blocks, positions % block_size].double()   # [T, Hkv, D]
        values = v_pool[blocks, positions % block_size].double()
        out = sdpa_attention(query[i:i + 1].double(), keys, values,
                             query_positions=torch.tensor([seq_len - 1]))  # sees all its keys
        outputs.append(out[0])
    return torch.stack(outputs)


def max_score(query, k_pool, tables, seq_lens, block_size):
    """The largest |score| of the case, for the failure messages."""
    top = 0.0
    for i, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        keys = k_pool[torch.tensor(tables[i])[positions // block_size], positions % block_size]
        q = query[i].double().unflatten(0, (keys.shape[1], -1))  # [Hkv, group, D]
        scores = torch.einsum("hgd,thd->hgt", q, keys.double()) / math.sqrt(query.shape[-1])
        top = max(top, scores.abs().max().item())
    return top


def to_layout(pool, layout):
    return pool if layout == TOKEN_MAJOR else pool.transpose(1, 2).contiguous()


def assert_matches(out, expected, dtype, what):
    out = out.cpu()
    assert not out.isnan().any(), (f"{what}: NaN in the output (not every element written, "
                                   f"poison leaked in, or exp2 overflowed: no running max?)")
    error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]}"


# Pairwise cover: every group size (1, 2, 4, 7, 8; 8 with one KV head is MQA), every head_dim
# (teaching sizes 8, 12, 16 and 64, 80, 96, 128, 256), each dtype and layout several times,
# block sizes 1 to 128, lengths = 0 and 1 (mod block_size) and seq_len 1.
CASES = [  # seq_lens, block_size, num_kv_heads, group, head_dim, dtype, layout
    ([1, 16, 17, 33], 16, 2, 1, 64, torch.float32, TOKEN_MAJOR),
    ([8, 9, 1, 5], 4, 2, 2, 80, torch.float16, HEAD_MAJOR),
    ([24, 25, 2], 8, 2, 4, 96, torch.bfloat16, TOKEN_MAJOR),
    ([3, 7, 40], 1, 1, 8, 128, torch.float32, HEAD_MAJOR),       # MQA, block_size 1
    ([130, 1], 128, 2, 7, 256, torch.float16, TOKEN_MAJOR),
    ([5, 6, 31, 1], 3, 2, 7, 12, torch.float32, HEAD_MAJOR),     # block_size not a power of 2
    ([33, 32, 1], 32, 1, 8, 8, torch.bfloat16, HEAD_MAJOR),
    ([64, 65], 64, 4, 2, 16, torch.float16, TOKEN_MAJOR),
    ([18, 2, 1], 2, 2, 1, 128, torch.bfloat16, HEAD_MAJOR),
    ([49, 12], 12, 1, 4, 256, torch.float32, HEAD_MAJOR),
]


# Scores up to about 1000 (exp2 overflows float32 past 128, i.e. a score of 88), growing late:
# 150 tokens in blocks of 4 to 16 are 10 to 38 blocks and 10 tiles, cut into 4 splits of 48
# tokens whose last holds the max; the sequence of 37 leaves 3 splits empty, that of 1 leaves 4.
LARGE_SCORE_CASES = [  # seq_lens, block_size, num_kv_heads, group, head_dim, dtype, layout
    ([150, 37, 1], 4, 2, 4, 64, torch.float32, TOKEN_MAJOR),
    ([1, 150, 37], 8, 2, 2, 64, torch.float16, HEAD_MAJOR),
    ([37, 1, 150], 16, 1, 8, 128, torch.bfloat16, TOKEN_MAJOR),
]


def check_decode_with_and_without_split(case, seed, num_splits, large=False):
    seq_lens, block_size, num_kv_heads, group, head_dim, dtype, layout = case
    query, k_pool, v_pool, block_tables, lens, tables = scatter_case(
        seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed=seed, large=large)
    expected = reference_decode(query, k_pool, v_pool, tables, seq_lens, block_size)
    scores = f"scores up to {max_score(query, k_pool, tables, seq_lens, block_size):.0f}, "
    k_cache, v_cache = on_device(to_layout(k_pool, layout), to_layout(v_pool, layout))
    query, block_tables, lens = on_device(query, block_tables, lens)
    results = {}
    for splits in (1, num_splits):
        out = torch.full_like(query, float("nan"))
        pa.paged_attention_decode(query, k_cache, v_cache, block_tables, lens, layout=layout,
                                  num_splits=splits, out=out, tile=16)
        assert_matches(out, expected, dtype, f"{scores}{splits} split(s)")
        results[splits] = out.double().cpu()
    torch.testing.assert_close(results[1], results[num_splits], rtol=0,
                               atol=2 * TOLERANCE[dtype] * expected.abs().max().item())


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_decode_matches_float64_reference_with_and_without_split(case_index):
    check_decode_with_and_without_split(CASES[case_index], seed=100 + case_index, num_splits=3)


@pytest.mark.parametrize("case_index", range(len(LARGE_SCORE_CASES)))
def test_large_scores_whose_max_grows_late_with_and_without_split(case_index):
    check_decode_with_and_without_split(LARGE_SCORE_CASES[case_index], seed=200 + case_index,
                                        num_splits=4, large=True)


@pytest.mark.parametrize("prefetch_ids", [True, False], ids=["ids-ahead", "ids-same-tile"])
def test_both_loops_of_the_compile_comparison_match_reference(prefetch_ids):
    # plan_decode's prefetch_ids=False is the loop notebook 05c compiles beside the library's:
    # the same arithmetic, so both must match. Block size 12 and 20 (not powers of two; 20 >
    # the tile).
    for block_size in (12, 20):
        query, k_pool, v_pool, block_tables, lens, tables = scatter_case(
            [70, 3, 41], block_size, 2, 4, 64, torch.float32, seed=8)
        expected = reference_decode(query, k_pool, v_pool, tables, [70, 3, 41], block_size)
        query, k_pool, v_pool, block_tables, lens = on_device(query, k_pool, v_pool,
                                                              block_tables, lens)
        out = torch.full_like(query, float("nan"))
        launch = pa.plan_decode(query, k_pool, v_pool, block_tables, lens, out, max_seq_len=70,
                                num_splits=1, num_sms=1, capability=None, tile=16,
                                prefetch_ids=prefetch_ids)
        assert launch.constants["PREFETCH_IDS"] is prefetch_ids and launch.partial is None
        pa._paged_decode_kernel[launch.grid](*launch.args, **launch.constants)
        assert_matches(out, expected, torch.float32, f"block_size {block_size}")


def test_default_tile_and_splits_match_reference():
    query, k_pool, v_pool, block_tables, lens, tables = scatter_case(
        [70, 3], 16, 2, 4, 64, torch.float32, seed=7)
    expected = reference_decode(query, k_pool, v_pool, tables, [70, 3], 16)
    out = pa.paged_attention_decode(*on_device(query, k_pool, v_pool, block_tables, lens.long()))
    assert out.shape == query.shape and out.dtype == query.dtype
    assert_matches(out, expected, torch.float32, "defaults")


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_block_full_of_nan_never_reaches_the_output(layout):
    # The correctness issue's small case: 6 blocks x 4 tokens, 4 query / 2 KV heads, head_dim 8;
    # block 0 is full of NaN, then 2 tokens are written into slots 0-1 (block 0, offsets 0-1).
    pool_shape = (6, 4, 2, 8) if layout == TOKEN_MAJOR else (6, 2, 4, 8)
    k_cache = torch.full(pool_shape, float("nan"), device=DEVICE)
    v_cache = torch.full(pool_shape, float("nan"), device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    key, value = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    write_kv(k_cache, v_cache, *on_device(key, value, torch.tensor([0, 1])), layout=layout)
    query = torch.randn(1, 4, 8, generator=gen)
    out = pa.paged_attention_decode(*on_device(query, k_cache, v_cache, torch.tensor([[0]]),
                                               torch.tensor([2])), layout=layout)
    q = query[0].double().view(2, 2, 8)
    scores = torch.einsum("hgd,thd->hgt", q, key.double()) / math.sqrt(8)
    expected = torch.einsum("hgt,thd->hgd", scores.softmax(-1), value.double()).reshape(1, 4, 8)
    assert torch.isfinite(out).all()
    assert_matches(out, expected, torch.float32, "NaN block 0")


GUARD_BLOCKS = 2  # blocks of sentinel on each side of the pool the kernel is handed
SENTINEL = -7777.0


def guarded_pool(token_major, layout):
    """(guarded, pool): `token_major` in `layout`, inside GUARD_BLOCKS blocks of SENTINEL before and
    after; `pool` is the view of the middle, the only memory a kernel handed it may touch."""
    inner = to_layout(token_major, layout)
    shape = (inner.shape[0] + 2 * GUARD_BLOCKS, *inner.shape[1:])
    guarded = torch.full(shape, SENTINEL, dtype=inner.dtype, device=DEVICE)
    pool = guarded[GUARD_BLOCKS:GUARD_BLOCKS + inner.shape[0]]
    pool.copy_(inner)
    return guarded, pool


def assert_guards_untouched(guarded, what):
    for name, guard in (("before", guarded[:GUARD_BLOCKS]), ("after", guarded[-GUARD_BLOCKS:])):
        changed = int((guard != SENTINEL).sum())
        assert changed == 0, f"{what}: {changed} elements written in the guard blocks {name} the pool"


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_write_kv_stores_at_slots_and_skips_minus_one(layout):
    # Slot -1 (padding) first, in the middle and last; slots 0 and 14 are the pool's first and
    # last: a -1 taken for a slot would land one slot before the pool (block 0, offset -1 in C's
    # integer division), i.e. in the guard.
    gen = torch.Generator().manual_seed(12)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 3, 3, 12
    token_major = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    guarded_k, k_cache = guarded_pool(token_major, layout)
    guarded_v, v_cache = guarded_pool(-token_major, layout)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([-1, 7, -1, 0, 14, -1], dtype=torch.int32)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    write_kv(k_cache, v_cache, *on_device(key, value, slots), layout=layout)
    assert_guards_untouched(guarded_k, f"{layout} K")
    assert_guards_untouched(guarded_v, f"{layout} V")
    expected_k, expected_v = before_k.cpu(), before_v.cpu()
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for cache, new in ((expected_k, key), (expected_v, value)):
            if layout == TOKEN_MAJOR:
                cache[block, offset] = new[token]
            else:
                cache[block, :, offset] = new[token]
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_decode_reads_nothing_outside_a_guarded_pool(layout):
    # The guards hold NaN: a read outside the pool's view would reach the output.
    query, k_pool, v_pool, block_tables, lens, tables = scatter_case(
        [9, 1, 20], 4, 2, 2, 16, torch.float32, seed=14)
    expected = reference_decode(query, k_pool, v_pool, tables, [9, 1, 20], 4)
    caches = []
    for pool in (k_pool, v_pool):
        guarded, view = guarded_pool(pool, layout)
        guarded[:GUARD_BLOCKS] = float("nan")
        guarded[-GUARD_BLOCKS:] = float("nan")
        caches.append(view)
    for num_splits in (1, 2):
        out = pa.paged_attention_decode(*on_device(query), *caches, *on_device(block_tables, lens),
                                        layout=layout, num_splits=num_splits, tile=16)
        assert_matches(out, expected, torch.float32, f"{layout}, {num_splits} split(s), guarded")


def test_bad_inputs_raise_clear_errors(monkeypatch):
    query, k_pool, v_pool, block_tables, lens, _ = scatter_case(
        [5, 2], 4, 2, 2, 8, torch.float32, seed=13)
    cpu_inputs = (query, k_pool, v_pool, block_tables, lens)
    query, k_pool, v_pool, block_tables, lens = on_device(*cpu_inputs)
    decode = pa.paged_attention_decode
    assert block_tables.shape[1] == 3  # 2 blocks + 1 padding entry: room for 12 tokens
    with pytest.raises(ValueError, match="seq_lens must be in 1..12"):
        decode(query, k_pool, v_pool, block_tables, torch.tensor([13, 2], device=DEVICE))
    with pytest.raises(ValueError, match="seq_lens must be in 1..12"):
        decode(query, k_pool, v_pool, block_tables, torch.tensor([0, 2], device=DEVICE))
    with pytest.raises(ValueError, match="block ids must be in 0..4"):
        decode(query, k_pool, v_pool, block_tables + 10, lens)
    with pytest.raises(ValueError, match="cannot be grouped"):
        decode(query[:, :3], k_pool, v_pool, block_tables, lens)
    with pytest.raises(ValueError, match="unknown pool layout"):
        decode(query, k_pool, v_pool, block_tables, lens, layout="row-major")
    with pytest.raises(ValueError, match="dtypes differ"):
        decode(query.half(), k_pool, v_pool, block_tables, lens)
    with pytest.raises(ValueError, match="int32 or int64"):
        decode(query, k_pool, v_pool, block_tables.float(), lens)
    with pytest.raises(ValueError, match="slots must be -1"):
        write_kv(k_pool, v_pool, query[:, :2], query[:, :2],
                 torch.tensor([3, 40], device=DEVICE))
    monkeypatch.setattr(pa, "INTERPRETED", False)  # CPU tensors, no interpreter: refused
    with pytest.raises(ValueError, match="need a CUDA GPU, or TRITON_INTERPRET=1"):
        decode(*cpu_inputs)


def test_max_seq_len_below_the_longest_sequence_is_refused():
    # The repro: 100 tokens with max_seq_len 20 read only the first 32 (one tile of 32).
    query, k_pool, v_pool, block_tables, lens, tables = scatter_case(
        [100, 7], 16, 2, 2, 16, torch.float32, seed=15)
    inputs = on_device(query, k_pool, v_pool, block_tables, lens)
    with pytest.raises(ValueError, match=r"max_seq_len 20 is below the longest seq_len 100 "
                                         r"\(sequence 0\)"):
        pa.paged_attention_decode(*inputs, max_seq_len=20)
    expected = reference_decode(query, k_pool, v_pool, tables, [100, 7], 16)
    for max_seq_len in (None, 100, 130):  # computed, exact, and larger than needed: all right
        out = pa.paged_attention_decode(*inputs, max_seq_len=max_seq_len, num_splits=2)
        assert_matches(out, expected, torch.float32, f"max_seq_len {max_seq_len}")


def _bad_decode_calls():
    """(what, call(inputs) -> kwargs changes, message): each would give a wrong answer silently
    (or a crash deep in the launch) if it were not refused."""
    def strided(t):  # the same numbers every other element of a bigger tensor
        return torch.stack([t, torch.full_like(t, 10 ** 6)], 1)[:, 0]

    return [
        ("seq_len 0", lambda i: dict(seq_lens=torch.tensor([0, 2], device=DEVICE)),
         r"seq_lens must be in 1\.\.12 .* got 0 for sequence 0"),
        ("block table narrower than the sequence",
         lambda i: dict(block_tables=i["block_tables"][:, :1]),
         r"seq_lens must be in 1\.\.4 \(block table width 1 x block_size 4, the pool read as "
         r"token-major .*got 5 for sequence 0"),
        ("strided seq_lens", lambda i: dict(seq_lens=strided(i["seq_lens"])),
         r"seq_lens must be contiguous \(stride 1\), got stride 2"),
        ("out of another shape", lambda i: dict(out=torch.empty(2, 4, 4, device=DEVICE)),
         r"out must be \(2, 4, 8\) torch.float32 like query, got \(2, 4, 4\) torch.float32"),
        ("out of another dtype",
         lambda i: dict(out=torch.empty(2, 4, 8, device=DEVICE, dtype=torch.float16)),
         r"out must be \(2, 4, 8\) torch.float32 like query, got \(2, 4, 8\) torch.float16"),
        ("num_splits 0", lambda i: dict(num_splits=0), r"num_splits must be an integer >= 1, got 0"),
        ("num_splits 2.5", lambda i: dict(num_splits=2.5),
         r"num_splits must be an integer >= 1, got 2\.5"),
        ("max_seq_len 0", lambda i: dict(max_seq_len=0),
         r"max_seq_len must be an integer >= 1, got 0"),
        ("max_seq_len 4", lambda i: dict(max_seq_len=4),
         r"max_seq_len 4 is below the longest seq_len 5 \(sequence 0\)"),
        # 2 KV heads x block_size 4 read as 4 KV heads x block_size 2. (Sizes that fit either
        # way cannot be told apart: see kvlab.kernels.validate.)
        ("head-major pool read as token-major",
         lambda i: dict(query=i["query"][:, :2], k_cache=i["k_cache"].transpose(1, 2).contiguous(),
                        v_cache=i["v_cache"].transpose(1, 2).contiguous()),
         r"2 query heads cannot be grouped over 4 KV heads \(the pool read as token-major "
         r"\[num_blocks, block_size, num_kv_heads, head_dim\]\)"),
        ("tile 24", lambda i: dict(tile=24), r"tile must be a power of two >= 16, got 24"),
    ]


@pytest.mark.parametrize("what, change, message", _bad_decode_calls(),
                         ids=[case[0] for case in _bad_decode_calls()])
def test_each_argument_that_would_silently_give_a_wrong_answer_is_refused(what, change, message):
    query, k_pool, v_pool, block_tables, lens, _ = scatter_case(
        [5, 2], 4, 2, 2, 8, torch.float32, seed=13)
    names = ("query", "k_cache", "v_cache", "block_tables", "seq_lens")
    inputs = dict(zip(names, on_device(query, k_pool, v_pool, block_tables, lens)))
    with pytest.raises(ValueError, match=message):
        pa.paged_attention_decode(**{**inputs, **change(inputs)})


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_write_kv_refuses_a_strided_slot_mapping_and_a_pool_elsewhere(layout):
    k_cache = torch.zeros(pa_pool_shape(layout), device=DEVICE)
    key = torch.ones(2, 2, 8, device=DEVICE)
    slots = torch.tensor([[1, 5], [2, 6]], device=DEVICE)[:, 0]  # slots 1 and 2, stride 2
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv(k_cache, k_cache.clone(), key, key, slots, layout=layout)
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="all inputs must be on one device"):
            write_kv(k_cache, k_cache.clone(), key, key, slots.cpu().contiguous(), layout=layout)
    assert k_cache.abs().sum() == 0  # a refused call writes nothing


def pa_pool_shape(layout):
    return (3, 4, 2, 8) if layout == TOKEN_MAJOR else (3, 2, 4, 8)


def test_empty_batch_returns_an_empty_output():
    query, k_pool, v_pool, block_tables, lens, _ = scatter_case(
        [5], 4, 2, 2, 8, torch.float32, seed=16)
    query, k_pool, v_pool = on_device(query, k_pool, v_pool)
    empty_tables = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    out = pa.paged_attention_decode(query[:0], k_pool, v_pool, empty_tables,
                                    torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 4, 8)


def test_split_heuristic_fills_one_wave_of_resident_programs():
    # 132 SMs x 4 resident programs = 528 at once. 1 sequence x 8 KV heads: 528 // 8 = 66 splits
    # would fit, capped at 64; 4 sequences: 16 (17 would start a second wave of 16 programs).
    assert choose_num_splits(1, 8, 32768, 132) == 64
    assert choose_num_splits(4, 8, 32768, 132) == 16
    assert choose_num_splits(16, 8, 4096, 132) == 4
    assert choose_num_splits(64, 8, 4096, 132) == 1         # 512 programs fill the wave already
    assert choose_num_splits(1, 8, 32768, 132, programs_per_sm=1) == 16   # one per SM: 132 // 8
    assert choose_num_splits(1, 8, 600, 132) == 2            # too short for more than 2 splits
    assert choose_num_splits(1, 1, 10**6, 132) == 64         # capped
    assert tokens_per_split(100, 3, 16) == 48                # ceil(100/3) = 34 -> 3 tiles of 16
    with pytest.raises(ValueError, match="num_sms must be >= 1"):
        choose_num_splits(1, 8, 100, 0)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 16, 33, 66, 67, 200])
@pytest.mark.parametrize("context", [256, 4096, 32768])
def test_splitting_never_spills_into_a_second_wave(num_seqs, context):
    programs = num_seqs * 8
    splits = choose_num_splits(num_seqs, 8, context, 132)
    one_wave = 132 * PROGRAMS_PER_SM
    assert splits == 1 or programs * splits <= one_wave
    assert splits == 1 or context // splits >= MIN_TOKENS_PER_SPLIT
    more = splits + 1  # one more split would spill, run too short a split, or pass the cap
    assert (programs * more > one_wave or context // more < MIN_TOKENS_PER_SPLIT
            or more > MAX_SPLITS)


def test_resident_programs_is_the_tightest_of_registers_shared_memory_and_slots():
    # sm_90: 65,536 registers, 228 KiB of shared memory, 64 warps, 32 blocks per SM. 4 warps of
    # 158 registers (rounded to 160 per thread) fit 3 times; 124 (128) 4 times.
    assert resident_programs(158, 39_168 + 1024, 4) == 3
    assert resident_programs(124, 39_168 + 1024, 4) == 4
    assert resident_programs(32, 100_000, 4) == 2              # shared memory: 2 x 101 KB
    assert resident_programs(16, 0, 32) == 2                   # warps: 64 // 32
    assert resident_programs(8, 0, 1) == 32                    # blocks
    with pytest.raises(ValueError, match="registers"):
        resident_programs(0, 0, 4)


def test_importing_kvlab_kernels_does_not_import_triton():
    code = ("import sys, kvlab.kernels, kvlab.kernels.pool_layout, kvlab.kernels.split_kv, "
            "kvlab.kernels.validate; assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.cuda
@pytest.mark.parametrize("large", [False, True], ids=["random", "large-scores"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_cuda_llama_8b_shape_matches_reference(dtype, layout, large):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bfloat16 needs compute capability 8.0")
    seq_lens = [1, 17, 512, 2049, 4096]
    query, k_pool, v_pool, block_tables, lens, tables = scatter_case(
        seq_lens, 16, 8, 4, 128, dtype, seed=21, large=large)
    expected = reference_decode(query, k_pool, v_pool, tables, seq_lens, 16)
    k_cache, v_cache = to_layout(k_pool, layout).cuda(), to_layout(v_pool, layout).cuda()
    for num_splits in (None, 1, 8):
        out = pa.paged_attention_decode(query.cuda(), k_cache, v_cache, block_tables.cuda(),
                                        lens.cuda(), layout=layout, num_splits=num_splits)
        assert_matches(out.cpu(), expected, dtype, f"cuda, splits {num_splits}")


@pytest.mark.cuda
def test_cuda_bf16_below_sm80_is_refused():
    if torch.cuda.get_device_capability()[0] >= 8:
        pytest.skip("this card supports bfloat16")
    query, k_pool, v_pool, block_tables, lens, _ = scatter_case(
        [5], 4, 2, 2, 64, torch.bfloat16, seed=22)
    with pytest.raises(ValueError, match="compute capability >= 8.0"):
        pa.paged_attention_decode(query.cuda(), k_pool.cuda(), v_pool.cuda(),
                                  block_tables.cuda(), lens.cuda())


# ---- the layout picture: which addresses one program reads (pure Python, no Triton needed) ----

def test_token_major_reads_one_run_per_token_head_major_one_per_block():
    from kvlab.kernels.pool_layout import program_addresses, run_stats

    # 2 KV heads, head_dim 4, blocks of 4 tokens; a sequence of 6 tokens in blocks 3 and 1.
    table, seq_len = [3, 1], 6
    token = run_stats(TOKEN_MAJOR, table, seq_len, 1, 4, 2, 4, element_bytes=2)
    head = run_stats(HEAD_MAJOR, table, seq_len, 1, 4, 2, 4, element_bytes=2)
    assert (token.num_runs, token.bytes_read, token.max_run_bytes) == (6, 48, 8)
    assert (head.num_runs, head.bytes_read, head.max_run_bytes, head.min_run_bytes) == (2, 48, 32, 16)
    # Token-major: head 1 of token 0 (block 3, slot 0) starts at 3*32 + 0*8 + 1*4 = 100.
    assert program_addresses(TOKEN_MAJOR, table, seq_len, 1, 4, 2, 4)[:5] == [100, 101, 102, 103, 108]
    # Head-major: head 1 of block 3 starts at 3*32 + 1*16 = 112, 4 tokens x 4 dims in one run.
    assert program_addresses(HEAD_MAJOR, table, seq_len, 1, 4, 2, 4)[:17] == list(range(112, 128)) + [48]


def test_layout_picture_draws_both_layouts():
    import matplotlib
    matplotlib.use("Agg")
    from kvlab.kernels.pool_layout import plot_program_reads

    ax = plot_program_reads([2, 0], 5, 0, 4, 2, 4)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["token-major\n5 runs",
                                                            "head-major\n2 runs"]
