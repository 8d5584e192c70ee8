"""Stage 5: split-KV (flash-decoding) for the paged decode kernel, run in Triton's interpreter on CPU.

Grades `stage5_paged_attention.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 5`. Each piece is tried alone first (`split_range` and `combine_splits` through small
kernels of this file; the partials each split stores; the combine of hand-made partials), then the
whole split decode against float64 attention (PyTorch SDPA, `kvlab.oracles`) on ragged sequences
in shuffled blocks, padded with a block of NaN, with NaN in every slot a sequence does not own.

What small random scores hide:

* split ranges that run past a sequence's end read slots that are not its own: only NaN there
  makes that visible, so the pools are NaN outside the sequences;
* splits too short to cover the longest sequence (a split length rounded down) drop its last
  positions: the partials are compared split by split, so the missing positions show;
* a combine without the largest max (exp(m) as it is) is right while every m is small: the
  partials of `test_combine_splits_of_large_scores_needs_the_largest_max` have maxima of about
  1000 (exp overflows float32 above 88), and the last case of the decode uses integer queries
  and keys whose scores reach about 1000;
* a combine that ignores the maxima altogether is right only when every split has the same one:
  the hand-made partials have maxima several units apart, and empty and padding splits
  (m = -inf, l = 0, acc = 0) that must weigh exactly 0;
* Triton's CPU interpreter loads and stores real memory: a lane left unmasked reads or writes
  past its tensor without an error (and a stray store can crash Python). So every partial a
  kernel reads or writes is a view inside a margin of NaN (`nan_partials` in the learner's file
  for the partials a split stores; `in_nan_margin` here for the combine's inputs): a stray read
  brings NaN into the output, and a stray store leaves the margin changed, which is checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.tools.grading import assert_close, assert_equal
from kvlab.oracles import sdpa_attention

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

# Triton 3.6's interpreter cannot run `for i in range(start, end)` with a bound read at run time
# under NumPy >= 2.4 (docs/troubleshooting.md); this applies Triton 3.7's conversion, or nothing.
from kvlab.tools.tour.triton_compat import fix_interpreter_index  # noqa: E402

fix_interpreter_index()

# Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest.py sets
# TRITON_INTERPRET=1); with one, on the GPU, where tl.dot on float32 uses TF32 (about 1e-3).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 2e-3 if DEVICE == "cuda" else 1e-5


def in_nan_margin(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into a buffer with as many rows of NaN again before and after it, and
    returned as the view of its rows there: a read past either end of it gives NaN."""
    rows = tensor.shape[0]
    buffer = torch.full((3 * rows, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype,
                        device=tensor.device)
    buffer[rows:2 * rows] = tensor
    return buffer[rows:2 * rows]


def assert_margin_untouched(partial: torch.Tensor, name: str, what: str) -> None:
    """`partial` is a view of rows inside a NaN buffer (`nan_partials`): fails if a kernel
    wrote to any row of that buffer outside the view. A learner's file that allocates its
    partials without a margin is not checked here."""
    buffer = partial._base
    if buffer is None or not partial.is_contiguous():
        return
    row = partial[0].numel()
    first = (partial.storage_offset() - buffer.storage_offset()) // row
    rows = buffer.reshape(buffer.shape[0], -1).isnan().all(dim=1).logical_not().cpu()
    before, after = int(rows[:first].sum()), int(rows[first + partial.shape[0]:].sum())
    where = " and ".join(f"{count} row(s) {side}" for count, side in
                         ((before, "before their first"), (after, "past their last")) if count)
    assert not where, (f"{what}{name}: your kernel wrote outside the partials, {where} (of "
                       f"{partial.shape[0]} rows): mask the group's padding rows")


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage5_paged_attention.py")


# ---- split_range, alone ----------------------------------------------------------------------

@triton.jit
def _range_kernel(out_ptr, seq_len, split_len, SPLIT_RANGE: tl.constexpr):
    split = tl.program_id(0)
    start, end = SPLIT_RANGE(seq_len, split, split_len)
    tl.store(out_ptr + 2 * split, start)
    tl.store(out_ptr + 2 * split + 1, end)


@pytest.mark.parametrize("seq_len, split_len, num_splits", [
    (40, 16, 3),   # the last split holds 8 positions
    (48, 16, 3),   # every split full
    (5, 16, 3),    # splits 1 and 2 are empty
    (1, 4, 4),     # one token: splits 1, 2 and 3 are empty
])
def test_split_range_by_hand(ex, seq_len, split_len, num_splits):
    out = torch.full((num_splits, 2), -1, dtype=torch.int64, device=DEVICE)
    ex.launch(_range_kernel, (num_splits,), out, seq_len, split_len, SPLIT_RANGE=ex.split_range)
    got = [tuple(pair) for pair in out.tolist()]
    what = f"split_range(seq_len={seq_len}, split=s, split_len={split_len}) for s = 0..{num_splits - 1}"
    for split, (start, end) in enumerate(got):
        expected_start = split * split_len
        if expected_start < seq_len:
            assert_equal((start, end), (expected_start, min(expected_start + split_len, seq_len)),
                         f"{what}, split {split} [split s covers s * split_len up to "
                         f"split_len positions, never past seq_len - 1]")
        else:
            assert_equal(end <= start, True,
                         f"{what}, split {split} starts past the end of a sequence of {seq_len} "
                         f"tokens, so it must cover nothing (end <= start), got ({start}, {end})")


# ---- combine_splits, alone -------------------------------------------------------------------

@triton.jit
def _combine_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, num_splits, COMBINE: tl.constexpr,
                    SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, 16)
    real = offs_s < num_splits
    parts = row * num_splits + offs_s
    m = tl.load(m_ptr + parts, mask=real, other=float("-inf"))
    l = tl.load(l_ptr + parts, mask=real, other=0.0)
    acc = tl.load(acc_ptr + parts[:, None] * 16 + offs_d[None, :], mask=real[:, None], other=0.0)
    tl.store(out_ptr + row * 16 + offs_d, COMBINE(m, l, acc))


def partials(scores: torch.Tensor, values: torch.Tensor, bounds: list[int]):
    """Each split's (m, l, acc), computed in float64 and given in float32, for scores [rows, n]
    and values [n, 16] cut at `bounds` (split s holds positions bounds[s] .. bounds[s+1] - 1;
    equal bounds make an empty split: m = -inf, l = 0, acc = 0)."""
    rows, splits = scores.shape[0], len(bounds) - 1
    m = torch.full((rows, splits), float("-inf"), dtype=torch.float64)
    l = torch.zeros(rows, splits, dtype=torch.float64)
    acc = torch.zeros(rows, splits, 16, dtype=torch.float64)
    for s in range(splits):
        part = scores[:, bounds[s]:bounds[s + 1]].double()
        if part.shape[1]:
            m[:, s] = part.amax(1)
            weights = torch.exp(part - m[:, s:s + 1])
            l[:, s] = weights.sum(1)
            acc[:, s] = weights @ values[bounds[s]:bounds[s + 1]].double()
    return m.float(), l.float(), acc.float()


def check_combine(ex, scores, values, bounds, what):
    m, l, acc = partials(scores, values, bounds)
    rows, splits = m.shape
    out = torch.full((rows, 16), float("nan"), device=DEVICE)
    ex.launch(_combine_kernel, (rows,), out, *(t.contiguous().to(DEVICE) for t in (m, l, acc)),
              splits, COMBINE=ex.combine_splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    expected = (scores.double().softmax(-1) @ values.double()).float()
    assert_close(out.cpu(), expected, what, atol=TOLERANCE, rtol=TOLERANCE)


def test_combine_splits_equals_softmax(ex):
    # 4 rows, 40 scores in 3 splits of 16, 16 and 8; spread out, so each split's max differs.
    gen = torch.Generator().manual_seed(1)
    scores, values = 3 * torch.randn(4, 40, generator=gen), torch.randn(40, 16, generator=gen)
    check_combine(ex, scores, values, [0, 16, 32, 40], (
        "combine_splits of 3 splits (16, 16 and 8 positions; maxima several units apart) vs "
        "softmax(scores) @ values [each split's l and acc are sums under its own max: scale "
        "both by exp(m_split - common max) before adding them up]"))


def test_combine_splits_with_empty_splits(ex):
    # A 5-token sequence cut into 4 splits of 4: splits 2 and 3 are empty, and the tile pads
    # to 4 splits with nothing: their m = -inf, l = 0, acc = 0 must weigh exactly 0.
    gen = torch.Generator().manual_seed(2)
    scores, values = 2 * torch.randn(3, 5, generator=gen), torch.randn(5, 16, generator=gen)
    check_combine(ex, scores, values, [0, 4, 5, 5, 5], (
        "combine_splits of 4 splits of which the last 2 are empty (m = -inf, l = 0, acc = 0) "
        "vs softmax(scores) @ values [an empty split must weigh exactly 0: exp(-inf - max) is "
        "0, but acc / l of an empty split is 0 / 0 = NaN]"))


def test_combine_splits_of_large_scores_needs_the_largest_max(ex):
    # Maxima of about 300, 600 and 950: exp(m) overflows float32 above 88.
    gen = torch.Generator().manual_seed(3)
    scores = 20 * torch.randn(2, 48, generator=gen) + torch.linspace(0, 900, 48)
    values = torch.randn(48, 16, generator=gen)
    check_combine(ex, scores, values, [0, 16, 32, 48], (
        f"combine_splits of 3 splits whose maxima reach {scores.max():.0f} vs softmax(scores) "
        f"@ values [exp() overflows float32 above 88: weigh each split by exp(m_split - the "
        f"largest m), never by exp(m_split) itself]"))


def test_combine_loads_each_rows_splits(ex):
    # 5 rows of 3 splits each, in tiles of 4 lanes: lane 3 is no split of its row (row r + 1's
    # first split sits right after row r's last). Each row its own scores and values, around
    # -200, 0 or +200: a padding lane loaded as m = 0 outweighs a row of scores far below 0.
    gen = torch.Generator().manual_seed(4)
    rows, bounds = 5, [0, 16, 32, 40]
    offsets = torch.tensor([-200.0, 0.0, 200.0, -200.0, 0.0])[:, None]
    scores = 3 * torch.randn(rows, 40, generator=gen) + offsets
    values = torch.randn(rows, 40, 16, generator=gen)
    parts = [partials(scores[r:r + 1], values[r], bounds) for r in range(rows)]
    # Inside NaN margins: a lane past the last row's splits that is read reads NaN.
    m, l, acc = (in_nan_margin(torch.cat([part[i] for part in parts]).to(DEVICE))
                 for i in range(3))
    out = ex.combine(m, l, acc)
    expected = torch.stack([(scores[r].double().softmax(-1) @ values[r].double()).float()
                            for r in range(rows)])
    assert_close(out.cpu(), expected, (
        "combine(m, l, acc) of 5 rows x 3 splits (tiles of 4 lanes) vs softmax(scores) @ values, "
        "row by row, each inside a margin of NaN [two usual causes: weights exp(m), which "
        "overflow (weigh by exp(m - the largest m)); or the loads: row r's splits are entries "
        "r * num_splits + s; a lane past num_splits is no split of row r: mask its loads of m, "
        "l and acc (past the last row lies NaN) and load it as an empty split, m = -inf, l = 0, "
        "acc = 0]"),
        atol=TOLERANCE, rtol=TOLERANCE)


# ---- the partials each split stores ----------------------------------------------------------

@pytest.mark.parametrize("seq_lens, block_size, num_kv_heads, group, num_splits", [
    ([40, 17, 1], 8, 2, 4, 3),   # splits of 14: 40 = 14 + 14 + 12; the short ones end early
    ([33, 2], 16, 2, 1, 4),      # splits of 9: the 2-token sequence has 3 empty splits
])
def test_partials_split_by_split(ex, seq_lens, block_size, num_kv_heads, group, num_splits):
    inputs, _, kv = decode_case(seq_lens, block_size, num_kv_heads, group, head_dim=16, seed=11)
    got = ex.paged_decode_partials(*inputs, num_splits=num_splits)
    query = inputs[0].cpu().double()
    split_len = -(-max(seq_lens) // num_splits)
    expected = [[], [], []]  # m, l, acc of every row (seq * num_heads + head), split by split
    for seq, n in enumerate(seq_lens):
        bounds = [min(s * split_len, n) for s in range(num_splits + 1)]
        for head in range(num_kv_heads * group):
            keys, values = (t[:, head // group].double() for t in kv[seq])
            scores = (query[seq, head] @ keys.T / math.sqrt(16))[None, :]
            for i, part in enumerate(partials(scores, values, bounds)):
                expected[i].append(part[0])
    what = (f"paged_decode_partials(seq_lens={seq_lens}, block_size={block_size}, "
            f"{num_kv_heads} KV heads x group {group}, num_splits={num_splits}): split s holds "
            f"{split_len} positions from s * {split_len}; ")
    names = ("m", "l", "acc")
    for name, mine in zip(names, got):
        assert_margin_untouched(mine, name, what)
    for name, mine, wanted in zip(names, got, expected):
        wanted = torch.stack(wanted)
        if name == "m":  # an empty split's max is -inf: compared as a number far below any score
            mine, wanted = (torch.where(t == float("-inf"), -1e30, t)
                            for t in (mine.cpu(), wanted))
        assert_close(mine.cpu(), wanted, what + (
            f"{name} [{', '.join(str(d) for d in wanted.shape)}] vs float64, row = seq * num_heads "
            f"+ head, column = split (nan: no program stored there)"), atol=TOLERANCE,
            rtol=TOLERANCE)


# ---- the whole split decode --------------------------------------------------------------

def decode_case(seq_lens, block_size, num_kv_heads, group, head_dim, seed, large=False):
    """Query, token-major pools poisoned with NaN outside the sequences, block tables, lengths;
    the float64 answer (SDPA); each sequence's (keys, values) [n, num_kv_heads, head_dim].
    `large`: integer queries in -16..16 and keys in -16..16 times 1, 2, 3 or 4 along the
    sequence, so scores reach about 1000 and each split's max differs from the next one's by
    hundreds; integers this small multiply exactly in float32 (and TF32),
    so only the softmax and the combine can be wrong."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 1
    k_pool = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block, free = free[0], free[1:]
    shape = (len(seq_lens), num_kv_heads * group, head_dim)
    query = (torch.randint(-16, 17, shape, generator=gen).float() if large
             else torch.randn(shape, generator=gen))
    tables, expected, kv = [], [], []
    for i, n in enumerate(seq_lens):
        count = math.ceil(n / block_size)
        table, free = free[:count], free[count:]
        keys, values = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(n)
        if large:
            growth = 1 + 4 * positions // n  # 1 in the first quarter, ..., 4 in the last
            keys = torch.randint(-16, 17, keys.shape, generator=gen) * growth[:, None, None].float()
        rows = torch.tensor(table)[positions // block_size]
        k_pool[rows, positions % block_size], v_pool[rows, positions % block_size] = keys, values
        attended = sdpa_attention(query[i:i + 1].double(), keys.double(), values.double(),
                                  query_positions=torch.tensor([n - 1]))  # sees all n keys
        expected.append(attended[0].float())
        tables.append(table)
        kv.append((keys, values))
    width = max(map(len, tables)) + 1
    block_tables = torch.tensor([t + [nan_block] * (width - len(t)) for t in tables],
                                dtype=torch.int32)
    inputs = (query, k_pool, v_pool, block_tables, torch.tensor(seq_lens, dtype=torch.int32))
    return tuple(t.to(DEVICE) for t in inputs), torch.stack(expected), kv


@pytest.mark.parametrize("seq_lens, block_size, num_kv_heads, group, num_splits", [
    ([1, 16, 17, 40], 8, 2, 4, 3),   # splits of 14: the 1-token and 16-token sequences end early
    ([5, 3], 1, 1, 8, 2),            # block_size 1: a block per token
    ([33, 2], 16, 2, 1, 4),          # the 2-token sequence has 3 empty splits
    ([70, 23, 1], 4, 2, 4, 1),       # one split: notebook 05's kernel
])
def test_split_decode_matches_float64_attention(ex, seq_lens, block_size, num_kv_heads, group,
                                                num_splits):
    inputs, expected, _ = decode_case(seq_lens, block_size, num_kv_heads, group, head_dim=16,
                                      seed=len(seq_lens) + block_size)
    out = ex.paged_decode_split(*inputs, num_splits=num_splits)
    assert_close(out.cpu(), expected, (
        f"paged_decode_split(seq_lens={seq_lens}, block_size={block_size}, {num_kv_heads} KV "
        f"heads x group {group}, num_splits={num_splits}; blocks shuffled, padding and unused "
        f"slots NaN) vs float64 SDPA"), atol=TOLERANCE, rtol=TOLERANCE)


def test_split_decode_with_large_scores_matches_float64_attention(ex):
    # 70 tokens in blocks of 4, 3 splits of 24: scores up to about 1000, growing split by split.
    seq_lens, block_size = [70, 23, 1], 4
    inputs, expected, _ = decode_case(seq_lens, block_size, num_kv_heads=2, group=4,
                                      head_dim=16, seed=8, large=True)
    out = ex.paged_decode_split(*inputs, num_splits=3)
    assert_close(out.cpu(), expected, (
        f"paged_decode_split(seq_lens={seq_lens}, block_size={block_size}, num_splits=3; "
        f"integer q and k, scores up to about 1000 and growing along the sequence) vs float64 "
        f"SDPA [exp() overflows float32 above 88: weigh each split by exp(m_split - the "
        f"largest m)]"), atol=TOLERANCE, rtol=TOLERANCE)
