"""Stage 5 exercise: split-KV (flash-decoding) for the paged decode kernel, in Triton.

Notebook 05's kernel gives one program one KV head of one sequence, and that program walks all of
the sequence's tokens; notebook 05b (section 1) shows why a batch of a few long sequences then
leaves most of a GPU idle, and writes split-KV in PyTorch (non-empty splits, combined through
each split's output and log-sum-exp). Split-KV (Dao, Haziza, Massa and Sizov, "Flash-Decoding for long-context inference",
2023) adds a third grid axis: split s of a sequence walks only its own range of positions, through
the block table as before, and stores what its online softmax ends with (Milakov and Gimelshein,
2018), for each query head: the running max m of its scores, the running sum l of exp(score - m)
and the running output acc, the sum of exp(score - m) * value, not yet divided by l. A second
kernel, one program per query head of each sequence, combines the splits. Every launch has the
same number of splits for every sequence (a grid is a rectangle), so a short sequence may have
splits that hold no position at all.

Yours, five short pieces, in the order a decode step runs them:

* `paged_decode_partials`: the launch (how long a split is, and the grid);
* `split_range`: which positions split s walks;
* the end of `paged_decode_split_kernel`: where a program's (m, l, acc) go in the partials;
* the start of `combine_kernel`: one head's partials loaded into tiles whose length is a power of
  two, so there may be more lanes than splits;
* `combine_splits`: the output from the splits' (m, l, acc).

`kvlab check 5` runs your code in Triton's CPU interpreter (TRITON_INTERPRET=1, set below when
there is no GPU) against float64 attention, on ragged sequences in shuffled blocks with NaN in
every slot they do not own, and tries each piece alone first. Compare yours afterwards with the
library kernel, `kernels/paged_attention.py` (`_paged_decode_kernel` with SPLIT,
`_reduce_splits_kernel`), which stores each split's log-sum-exp and normalised output instead, in
base 2, and chooses the number of splits from the card (`kernels/split_kv.py`).

Units: positions and split_len are tokens; every float here is float32; m is in the units of the
scores (natural log: the kernels use tl.exp).
"""

from __future__ import annotations

import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's CPU interpreter; set before import

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def split_range(seq_len, split, split_len):
    """Returns (start, end): split `split` attends positions start .. end - 1 of a sequence of
    `seq_len` tokens (int32 scalars). Split s holds the s-th run of split_len positions, counted
    from position 0; no position at or past seq_len belongs to any split, and a split with no
    position has end <= start."""
    # BEGIN SOLUTION hint: which positions do splits 0 .. split - 1 hold? And where must this
    # hint: split stop when the sequence ends inside it, or before it begins?
    start = split * split_len
    return start, tl.minimum(start + split_len, seq_len)
    # END SOLUTION


@triton.jit
def combine_splits(m, l, acc):
    """The attention output of one query head from its splits' partial results.

    Args:
        m: [SPLITS] each split's max score.
        l: [SPLITS] each split's sum of exp(score - m) over its positions.
        acc: [SPLITS, HEAD_DIM] each split's sum of exp(score - m) * value.
        A split that holds no position holds what the split kernel's loop starts from.

    Returns:
        [HEAD_DIM] float32: softmax over all the head's scores, times the values. Split 0 always
        holds a position. Scores may be large (hundreds): exp() of float32 overflows above 88.
    """
    # BEGIN SOLUTION hint: each split's l and acc are sums under that split's own max, so they
    # hint: cannot be added as they are (notebook 05b, section 1, combined (output, lse) pairs;
    # hint: you hold (m, l, acc)). What must an empty split contribute?
    weights = tl.exp(m - tl.max(m, axis=0))
    return tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * l, axis=0)
    # END SOLUTION


@triton.jit
def paged_decode_split_kernel(m_ptr, l_ptr, acc_ptr, q_ptr, k_pool_ptr, v_pool_ptr,
                              block_tables_ptr, seq_lens_ptr, scale, max_blocks, split_len,
                              num_splits, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                              GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, num_splits): notebook 05's GQA program over one split's
    positions; stores that split's (m, l, acc) for each of the GROUP query heads into the
    partials (`paged_decode_partials` gives their layout)."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = split_range(seq_len, split, split_len)
    offs_g, offs_d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    real_row = offs_g < GROUP  # rows padding the group to the 16 rows tl.dot needs
    q_rows = seq * NUM_KV_HEADS * GROUP + heads  # this program's rows of query (and partials)
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=real_row[:, None],
                other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * max_blocks
    for tile_start in range(start, end, TILE):  # no iteration at all for an empty split
        positions = tile_start + tl.arange(0, TILE)
        owned = positions < end
        block_ids = tl.load(table + positions // BLOCK_SIZE, mask=owned, other=0).to(tl.int64)
        rows = (block_ids * BLOCK_SIZE + positions % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
        ptrs = rows[:, None] * HEAD_DIM + offs_d[None, :]
        # Masked loads: a slot that is not this split's may hold NaN, and 0 x NaN = NaN.
        k = tl.load(k_pool_ptr + ptrs, mask=owned[:, None], other=0.0)
        v = tl.load(v_pool_ptr + ptrs, mask=owned[:, None], other=0.0)
        scores = tl.where(owned[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    # BEGIN SOLUTION hint: q_rows numbers this program's query heads as rows of the partials;
    # hint: where does (row, split) sit in a contiguous [num_rows, num_splits] tensor? The rows
    # hint: that only pad the group are nobody's
    part = q_rows * num_splits + split
    tl.store(m_ptr + part, m, mask=real_row)
    tl.store(l_ptr + part, l, mask=real_row)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=real_row[:, None])
    # END SOLUTION


@triton.jit
def combine_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, num_splits, HEAD_DIM: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):
    """Grid (num_rows,): program r writes out[r] from row r's num_splits partials, held in tiles
    of SPLITS_PAD lanes (num_splits rounded up to a power of two)."""
    row = tl.program_id(0)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM)
    # BEGIN SOLUTION hint: where do row r's splits sit in m, l and acc? A lane past num_splits is
    # hint: no split of row r: what may it read, and what must it look like to combine_splits?
    real = offs_s < num_splits
    parts = row * num_splits + offs_s
    m = tl.load(m_ptr + parts, mask=real, other=float("-inf"))
    l = tl.load(l_ptr + parts, mask=real, other=0.0)
    acc = tl.load(acc_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :], mask=real[:, None],
                  other=0.0)
    # END SOLUTION
    tl.store(out_ptr + row * HEAD_DIM + offs_d, combine_splits(m, l, acc))


def launch(kernel, grid, *args, **constants) -> None:
    """kernel[grid](*args, **constants); a TODO left in a kernel comes back as the
    NotImplementedError it is, so `kvlab check` shows its hint. (The interpreter wraps errors
    raised in a kernel; the GPU compiler refuses `raise` and quotes the line.)"""
    try:
        kernel[grid](*args, **constants)
    except Exception as error:
        chain = [error]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        for cause in chain:
            if isinstance(cause, NotImplementedError):
                raise cause from None
        for cause in chain:
            todo = re.search(r"TODO\(stage 5\): [^\"]*", str(cause))
            if todo:
                raise NotImplementedError(todo.group(0)) from None
        raise


def combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Partials m, l [num_rows, num_splits] and acc [num_rows, num_splits, head_dim] (float32,
    contiguous, one device) -> the output [num_rows, head_dim] float32."""
    num_rows, num_splits, head_dim = acc.shape
    out = torch.empty(num_rows, head_dim, device=acc.device)
    launch(combine_kernel, (num_rows,), out, m, l, acc, num_splits, HEAD_DIM=head_dim,
           SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out


def nan_partials(num_rows: int, num_splits: int, head_dim: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m, l [num_rows, num_splits] and acc [num_rows, num_splits, head_dim], float32, NaN until a
    program stores there (a partial that no program wrote shows up in the checks).

    Each is a view into a buffer with num_rows + 16 more rows of NaN on either side. Triton's CPU
    interpreter loads and stores real memory, so a store past the partials would land in memory
    Python owns and can crash it (on a GPU: an illegal memory access); here it lands in the
    margin, where `kvlab check` looks (a group padded to 16 rows reaches 15 rows past its own).
    """
    margin = num_rows + 16

    def inside_margin(*row_shape: int) -> torch.Tensor:
        buffer = torch.full((2 * margin + num_rows, *row_shape), float("nan"), device=device)
        return buffer[margin:margin + num_rows]

    return inside_margin(num_splits), inside_margin(num_splits), inside_margin(num_splits, head_dim)


def paged_decode_partials(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
                          tile: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each split's (m, l, acc) for every query head of every sequence.

    Args:
        query: [num_seqs, num_heads, head_dim] float32, contiguous (head_dim a power of two >= 16).
        k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim] float32, contiguous.
        block_tables: [num_seqs, max_blocks] int32, contiguous, padded with any block id.
        seq_lens: [num_seqs] int32, >= 1.
        num_splits: splits per sequence, >= 1; all of equal length, together just long enough
            for the longest sequence (ceil(longest / num_splits) positions each).
        tile: tokens per loop iteration (a power of two >= 16).

    Returns:
        m, l [num_seqs * num_heads, num_splits] and acc [num_seqs * num_heads, num_splits,
        head_dim], float32, contiguous: row seq * num_heads + h is query head h of sequence seq
        (it reads KV head h // (num_heads / num_kv_heads)); an empty split keeps the values its
        loop starts from.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_pool.shape
    group = num_heads // num_kv_heads
    m, l, acc = nan_partials(num_seqs * num_heads, num_splits, head_dim, query.device)
    # BEGIN SOLUTION hint: how many positions must one split hold so that num_splits of them
    # hint: cover every sequence of the batch? And how many programs does the launch need now?
    split_len = -(-int(seq_lens.max()) // num_splits)
    grid = (num_seqs, num_kv_heads, num_splits)
    # END SOLUTION
    launch(paged_decode_split_kernel, grid, m, l, acc, query, k_pool, v_pool, block_tables,
           seq_lens, head_dim ** -0.5, block_tables.shape[1], split_len, num_splits,
           NUM_KV_HEADS=num_kv_heads, GROUP=group,
           GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
           HEAD_DIM=head_dim, TILE=tile)
    return m, l, acc


def paged_decode_split(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
                       tile: int = 16) -> torch.Tensor:
    """Decode attention of one query token per sequence over its blocks, in num_splits splits:
    the partials, then their combine. Arguments as `paged_decode_partials`'s. Returns
    [num_seqs, num_heads, head_dim] float32."""
    m, l, acc = paged_decode_partials(query, k_pool, v_pool, block_tables, seq_lens, num_splits,
                                      tile)
    return combine(m, l, acc).view(query.shape)
