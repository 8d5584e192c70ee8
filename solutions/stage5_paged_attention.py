"""Stage 5 exercise: the inner loop of a paged decode-attention kernel, in Triton.

One decode step: each sequence has one new query token (all its query heads) and attends over its
own keys and values, which sit in a block pool [num_blocks, block_size, num_kv_heads, head_dim],
scattered over the blocks its block table lists (vLLM paper, Kwon et al., SOSP 2023, section 4.1).
`paged_decode_kernel` below gives one program one KV head of one sequence, and the query heads that
share it (GQA) as the rows of one tile, and walks the sequence TILE tokens at a time. Like the
library kernel, it looks each tile's rows up one tile ahead: the rows of the first tile before the
loop, then in each iteration those of the next tile, kept for the next iteration (a loop-carried
value). Compiled as a `for` loop, that lets the GPU copy the next tile's keys and values while it
computes this one; looked up in the same iteration, their addresses would wait on the table load
and nothing could be copied ahead (`kernels/paged_attention.py`, `_attend_step`; notebook 05,
section 9, compiles both). Two pieces of the loop are yours:

* `lookup_rows`: the block-table lookup. Position p lives in block `block_table[p // block_size]`
  at offset `p % block_size`; which row of the pool (seen flat, one row per token slot and KV
  head) holds it? The loop calls it for the next tile's positions, so the last call asks for
  positions that are all past the sequence's end.
* `online_softmax_update`: fold one tile of scores and values into the running max, running sum
  and running output (Milakov and Gimelshein, 2018; FlashAttention, Dao et al., 2022, section 3.1),
  so attention is computed in one pass without storing all the scores.

`kvlab check 5` runs your kernel in Triton's CPU interpreter (TRITON_INTERPRET=1, set below when
there is no GPU) against a float64 reference. Compare yours afterwards with the library kernel,
`kernels/paged_attention.py` (`_tile_block_ids`, `_attend_step`, `_attend_tile`, `_attend_tokens`),
which carries block ids rather than rows, and adds split-KV, fp16/bf16 and two layouts.

Units: positions and block_size are tokens; block ids index the pool's first axis; every float
here is float32.
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
def lookup_rows(block_table_ptr, positions, owned, kv_head, BLOCK_SIZE: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr):
    """Pool rows of KV head `kv_head` for a tile of positions of one sequence.

    Args:
        block_table_ptr: pointer to the sequence's block table (int32 block ids, logical order).
        positions: [TILE] int32 positions in the sequence (the loop asks for the next tile's, one
            iteration before it reads them).
        owned: [TILE] bool, False for positions at or past the sequence's length (their block
            table entries may not exist: do not read them). The loop's last call owns none.
        kv_head: the KV head this program reads.

    Returns:
        [TILE] int64: the row of each position in the pool seen as
        [num_blocks * BLOCK_SIZE * NUM_KV_HEADS, head_dim], i.e.
        (block_id * BLOCK_SIZE + offset) * NUM_KV_HEADS + kv_head. Any value where not owned.
    """
    # BEGIN SOLUTION hint: two lookups, the block id of each position in the block table, then
    # hint: its row from block id and offset. Two rules: read a table entry only for an owned
    # hint: position (past the end there may be no entry, only memory that is not the table's),
    # hint: and make the arithmetic int64 before it grows (a big pool's rows pass 2^31)
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=owned, other=0)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    return slots * NUM_KV_HEADS + kv_head
    # END SOLUTION


@triton.jit
def online_softmax_update(m, l, acc, scores, values):
    """Fold one tile into the running softmax: returns the new (m, l, acc).

    Args:
        m: [ROWS] running max of the scores seen so far (-inf before the first tile).
        l: [ROWS] running sum of exp(score - m).
        acc: [ROWS, HEAD_DIM] running sum of exp(score - m) * value.
        scores: [ROWS, TILE] this tile's scores; -inf where a slot is not the sequence's.
        values: [TILE, HEAD_DIM] this tile's values (0 where not the sequence's).

    At the end, acc / l is the attention output. The first tile of a sequence always holds at
    least one real score, so m is finite from then on.
    """
    # BEGIN SOLUTION hint: m stays the max of every score seen so far, and l and acc stay sums of
    # hint: exp(score - m): so when a tile raises the max, what l and acc hold must be rescaled to
    # hint: the new max before the tile's own terms join them (acc's as a matrix product, tl.dot)
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, values)
    return m_new, l, acc
    # END SOLUTION


@triton.jit
def paged_decode_kernel(out_ptr, q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, seq_lens_ptr,
                        scale, max_blocks, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                        GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    """Grid (num_seqs, num_kv_heads): the GROUP query heads of one KV head of one sequence."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g, offs_d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    real_row = offs_g < GROUP  # rows padding the group to the 16 rows tl.dot needs
    q_rows = seq * NUM_KV_HEADS * GROUP + heads
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=real_row[:, None],
                other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * max_blocks
    # The first tile's rows; each iteration then looks up the next tile's (see the docstring).
    first = tl.arange(0, TILE)
    rows = lookup_rows(table, first, first < seq_len, kv_head, BLOCK_SIZE, NUM_KV_HEADS)
    # A while loop, not `for start in range(0, seq_len, TILE)`: Triton 3.6's interpreter cannot
    # turn a bound read at run time into a Python int under NumPy >= 2.4; a while runs anywhere.
    # (Compiled, only a `for` is software-pipelined: the library kernel keeps a `for` there.)
    start = 0
    while start < seq_len:
        positions = start + tl.arange(0, TILE)
        owned = positions < seq_len
        ahead = positions + TILE
        next_rows = lookup_rows(table, ahead, ahead < seq_len, kv_head, BLOCK_SIZE, NUM_KV_HEADS)
        ptrs = rows[:, None] * HEAD_DIM + offs_d[None, :]
        # Masked loads: a slot that is not this sequence's may hold NaN, and 0 x NaN = NaN.
        k = tl.load(k_pool_ptr + ptrs, mask=owned[:, None], other=0.0)
        v = tl.load(v_pool_ptr + ptrs, mask=owned[:, None], other=0.0)
        scores = tl.where(owned[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, scores, v)
        rows = next_rows
        start += TILE
    tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :], acc / l[:, None],
             mask=real_row[:, None])


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


def paged_decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, tile: int = 16) -> torch.Tensor:
    """Decode attention of one query token per sequence over its blocks.

    Args:
        query: [num_seqs, num_heads, head_dim] float32 (head_dim a power of two >= 16).
        k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim] float32, contiguous.
        block_tables: [num_seqs, max_blocks] int32, padded with any block id.
        seq_lens: [num_seqs] int32, >= 1.
        tile: tokens per loop iteration (a power of two >= 16).

    Returns:
        [num_seqs, num_heads, head_dim] float32; head h reads KV head h // (num_heads / num_kv_heads).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_pool.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    launch(paged_decode_kernel, (num_seqs, num_kv_heads), out, query, k_pool, v_pool,
           block_tables, seq_lens, head_dim ** -0.5, block_tables.shape[1],
           NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
           BLOCK_SIZE=block_size, HEAD_DIM=head_dim, TILE=tile)
    return out
