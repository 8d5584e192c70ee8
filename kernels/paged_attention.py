"""Stage 5: a Triton paged-attention decode kernel, GQA-aware, with online softmax and split-KV.

Each of `num_seqs` sequences has one new query token (all heads) and attends over its `seq_len`
keys and values, scattered over the pool blocks its block table names (vLLM paper, Kwon et al.,
SOSP 2023, section 4.1). The kernel reads them in place instead of gathering a contiguous copy.

* One **program** = one KV head of one sequence. Under GQA (Ainslie et al., 2023) it holds all
  `group = num_heads / num_kv_heads` query rows, so each K/V vector is read once; `tl.dot` needs
  16 rows, so the group is padded to 16 and the padding masked.
* **Block table lookup per token**: position p is slot `p % block_size` of block
  `block_table[p // block_size]`. The block id is cast to int64 first: in int32, block_id x stride
  wraps once one layer's pool holds 2^31 elements (131,072 blocks x 16 tokens x 8 KV heads x 128
  dims, 4 GiB of bf16; 65,536 blocks at head_dim 256).
* **Block ids one tile ahead**: compiled, the `for` loop is software-pipelined (num_stages 3 by
  default; cp.async from sm_80): the next tile's K/V copies are issued into a second shared-memory
  buffer while this one is computed. That needs their addresses a tile early, so the block ids are
  loop-carried, each iteration loading the next tile's. Loaded in the same iteration, the K/V
  addresses would wait on that load, and the compiler would keep one buffer and wait for every
  copy at the top of each tile (notebook 05c compiles both for sm_90).
* **Online softmax** (Milakov and Gimelshein, 2018; FlashAttention, Dao et al., 2022, section 3.1):
  running max `m`, sum `l` and output `acc` in float32, rescaled by exp(m_old - m_new); one pass.
* **Masks on values as well as scores**: slots past seq_len and padded block-table entries belong
  to someone else; loading them as 0 keeps a NaN left there out of the arithmetic (0 x NaN = NaN).
* **Split-KV** (flash-decoding): a long sequence is cut into splits, each writing a partial output
  and its log-sum-exp; a reduce kernel combines them (`kvlab.kernels.split_kv` chooses how many).
* **Layouts**: strides are passed by meaning (block, slot, head, dim), so token-major and
  head-major pools share the code (`kvlab.kernels.pool_layout`).

Under TRITON_INTERPRET=1 (NumPy on the CPU) two compile-time flags keep the GPU kernel unchanged:
UPCAST, because the interpreter's `tl.dot` on bfloat16 multiplies the wrong numbers (Triton issue
11584); WHILE_LOOP, because Triton 3.6's interpreter calls `int()` on a 1-element array for a
`range` bound, which NumPy 2.4 refuses (Triton 3.7 and later run the `for`). Compiled, the loop
stays a `for`: Triton software-pipelines only `scf.for` loops; compiled as a `while`, the same
loop gets no shared-memory buffers and no asynchronous copies (`kvlab.tools.compiled` with
`while_loop=True`; notebook 05c compiles both).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pool_layout import TOKEN_MAJOR, pool_strides
from .split_kv import choose_num_splits, tokens_per_split
from .validate import check_decode_inputs, check_interpreter, pool_geometry

__all__ = ["paged_attention_decode", "plan_decode", "DecodeLaunch", "kernel_constants",
           "INTERPRETED", "MIN_DOT_ROWS", "TILE_BYTES"]

# triton.jit reads TRITON_INTERPRET when a kernel is defined, i.e. when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's own helpers (tl.zeros, ...) were defined when Triton was first imported; if that was
# before TRITON_INTERPRET=1 was set, interpreted kernels cannot call them (see `validate`).
LANGUAGE_INTERPRETED = not isinstance(tl.zeros, triton.runtime.jit.JITFunction)
# The smallest M, N and K that tl.dot accepts on a GPU.
MIN_DOT_ROWS = 16
# A K tile's bytes. Compiled for sm_90 at batch 64 x 4,096 tokens with K and V double-buffered,
# 64 tokens x head_dim 128 x bf16 (16 KiB) took 128 registers a thread under Triton 3.6 and 156
# under 3.9 (3 programs per SM), 32 tokens 92 and 80; tests/test_triton_compile.py checks <= 128
# (4 programs of 128 threads per SM); notebook 05c section 3 prints the 32-token tile's figures.
TILE_BYTES = 8 * 1024


@triton.jit
def _tile_block_ids(block_table_ptr, tile_start, end, BLOCK_SIZE: tl.constexpr,
                    TILE: tl.constexpr):
    """The block id of each position in [tile_start, tile_start + TILE): [TILE] of the table's
    dtype, 0 (nothing read) at positions >= end. One per token, so any block_size works."""
    positions = tile_start + tl.arange(0, TILE)
    return tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=positions < end, other=0)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_ids, tile_start, end,
                 kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
                 stride_vb, stride_vt, stride_vh, stride_vd, qk_scale,
                 BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Positions [tile_start, tile_start + TILE) below `end`, in the blocks `block_ids` names
    (`_tile_block_ids`). q, acc [GROUP_PAD, HEAD_DIM_PAD]; acc, m_i, l_i fp32, scores in log2
    units (qk_scale includes log2(e)). Returns (acc, m_i, l_i)."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    positions = tile_start + tl.arange(0, TILE)
    owned = positions < end  # slots past the sequence's end are someone else's
    block_ids = block_ids.to(tl.int64)  # before multiplying by the block stride
    slots = (positions % BLOCK_SIZE).to(tl.int64)
    load_mask = owned[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + block_ids[:, None] * stride_kb + slots[:, None] * stride_kt
                + kv_head * stride_kh + offs_d[None, :] * stride_kd, mask=load_mask, other=0.0)
    v = tl.load(v_cache_ptr + block_ids[:, None] * stride_vb + slots[:, None] * stride_vt
                + kv_head * stride_vh + offs_d[None, :] * stride_vd, mask=load_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    scores = tl.where(owned[None, :], scores, float("-inf"))  # [GROUP_PAD, TILE]
    # Online softmax update: rescale what was accumulated under the old max.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_step(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, block_ids,
                 tile_start, end, kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
                 stride_vb, stride_vt, stride_vh, stride_vd, qk_scale,
                 BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 PREFETCH_IDS: tl.constexpr):
    """One tile of the loop; returns (acc, m_i, l_i, the block ids the next step takes). Without
    PREFETCH_IDS (kept to compare compiles) this tile's ids are loaded here and K/V wait on them."""
    if PREFETCH_IDS:
        next_ids = _tile_block_ids(block_table_ptr, tile_start + TILE, end, BLOCK_SIZE, TILE)
    else:
        block_ids = _tile_block_ids(block_table_ptr, tile_start, end, BLOCK_SIZE, TILE)
        next_ids = block_ids
    acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_ids,
                                 tile_start, end, kv_head,
                                 stride_kb, stride_kt, stride_kh, stride_kd,
                                 stride_vb, stride_vt, stride_vh, stride_vd, qk_scale,
                                 BLOCK_SIZE, TILE, HEAD_DIM, HEAD_DIM_PAD, UPCAST, DOT_PRECISION)
    return acc, m_i, l_i, next_ids


@triton.jit
def _attend_tokens(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, start, end,
                   kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
                   stride_vb, stride_vt, stride_vh, stride_vd, qk_scale,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_PAD: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PREFETCH_IDS: tl.constexpr,
                   WHILE_LOOP: tl.constexpr):
    """Positions [start, end), TILE tokens at a time; WHILE_LOOP under the interpreter."""
    block_ids = _tile_block_ids(block_table_ptr, start, end, BLOCK_SIZE, TILE)
    if WHILE_LOOP:
        tile_start = start
        while tile_start < end:
            acc, m_i, l_i, block_ids = _attend_step(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, block_ids,
                tile_start, end, kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
                stride_vb, stride_vt, stride_vh, stride_vd, qk_scale, BLOCK_SIZE, TILE,
                HEAD_DIM, HEAD_DIM_PAD, UPCAST, DOT_PRECISION, PREFETCH_IDS)
            tile_start += TILE
    else:
        for tile_start in range(start, end, TILE):
            acc, m_i, l_i, block_ids = _attend_step(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, block_ids,
                tile_start, end, kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
                stride_vb, stride_vt, stride_vh, stride_vd, qk_scale, BLOCK_SIZE, TILE,
                HEAD_DIM, HEAD_DIM_PAD, UPCAST, DOT_PRECISION, PREFETCH_IDS)
    return acc, m_i, l_i


@triton.jit
def _paged_decode_kernel(out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                         seq_lens_ptr, qk_scale, split_len,
                         stride_qs, stride_qh, stride_qd,
                         stride_os, stride_oh, stride_osplit, stride_od,
                         stride_ls, stride_lh, stride_lsplit, stride_bts,
                         stride_kb, stride_kt, stride_kh, stride_kd,
                         stride_vb, stride_vt, stride_vh, stride_vd,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TILE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, PREFETCH_IDS: tl.constexpr,
                         WHILE_LOOP: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, num_splits). Without SPLIT: the output [num_seqs, num_heads,
    head_dim] in out's dtype. With SPLIT: fp32 partials [num_seqs, num_heads, num_splits, head_dim]
    and their log2-sum-exp [num_seqs, num_heads, num_splits] (-inf for an empty split)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + offs_g  # the query heads that share this KV head
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    acc, m_i, l_i = _attend_tokens(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
                                   block_tables_ptr + seq * stride_bts, start, end, kv_head,
                                   stride_kb, stride_kt, stride_kh, stride_kd,
                                   stride_vb, stride_vt, stride_vh, stride_vd, qk_scale,
                                   BLOCK_SIZE, TILE, HEAD_DIM, HEAD_DIM_PAD, UPCAST, DOT_PRECISION,
                                   PREFETCH_IDS, WHILE_LOOP)

    has_tokens = l_i > 0.0  # False only for an empty split
    safe_l = tl.where(has_tokens, l_i, 1.0)
    result = tl.where(has_tokens[:, None], acc / safe_l[:, None], 0.0)
    out_ptrs = (out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit
                + offs_d[None, :] * stride_od)
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask)
    if SPLIT:
        lse = tl.where(has_tokens, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split * stride_lsplit, lse,
                 mask=offs_g < GROUP)


@triton.jit
def _reduce_splits_kernel(out_ptr, partial_ptr, lse_ptr, num_splits,
                          stride_os, stride_oh, stride_od,
                          stride_ps, stride_ph, stride_psplit, stride_pd,
                          stride_ls, stride_lh, stride_lsplit,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr):
    """Grid (num_seqs, num_heads): out = sum_s w_s * partial_s / sum_s w_s, w_s = 2^(lse_s - max)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    split_ok = offs_s < num_splits
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s * stride_lsplit,
                  mask=split_ok, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds a token, so max is finite
    weights = tl.where(split_ok & (lse > float("-inf")), weights, 0.0)
    partial = tl.load(partial_ptr + seq * stride_ps + head * stride_ph
                      + offs_s[:, None] * stride_psplit + offs_d[None, :] * stride_pd,
                      mask=split_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    partial = tl.where(weights[:, None] > 0.0, partial, 0.0)  # an empty split adds nothing
    result = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _tile_for(head_dim_pad: int, element_bytes: int, max_seq_len: int) -> int:
    """Tokens per tile: a K tile of <= 8 KiB, <= the longest sequence, >= 16 rows for tl.dot.
    fp16/bf16: head_dim 128 -> 32 tokens, 256 -> 16; fp32 head_dim 128 -> 16."""
    largest = max(MIN_DOT_ROWS, TILE_BYTES // (head_dim_pad * element_bytes))
    return max(MIN_DOT_ROWS, min(largest, triton.next_power_of_2(max_seq_len)))


def kernel_constants(dtype: torch.dtype, head_dim: int, group: int, block_size: int,
                     max_seq_len: int, capability: tuple[int, int] | None = None,
                     tile: int | None = None, prefetch_ids: bool = True,
                     while_loop: bool | None = None) -> dict:
    """The constexpr keyword arguments of `_paged_decode_kernel` except SPLIT (plus num_stages
    before sm_80). capability is None on CPU; prefetch_ids False compiles the loop that loads
    each tile's block ids in the same iteration, while_loop True the loop as a `while` (both to
    compare; while_loop None: a `while` only under the interpreter). ValueError: a tile not a
    power of two >= 16."""
    head_dim_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))
    old_gpu = capability is not None and capability[0] < 8
    element_bytes = torch.finfo(dtype).bits // 8
    if tile is None:
        tile = _tile_for(head_dim_pad, element_bytes, max_seq_len)
    elif tile < MIN_DOT_ROWS or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= {MIN_DOT_ROWS}, got {tile}")
    constants = dict(GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
                     HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
                     TILE=tile, UPCAST=INTERPRETED and dtype == torch.bfloat16,
                     # float32 dots in IEEE float32, not Triton's default TF32 on a GPU
                     DOT_PRECISION="ieee" if dtype == torch.float32 else None,
                     PREFETCH_IDS=prefetch_ids,
                     WHILE_LOOP=INTERPRETED if while_loop is None else while_loop)
    if old_gpu:  # fewer tiles in flight: a T4 (sm_75) has 64 KiB of shared memory per SM
        constants["num_stages"] = 2
    return constants


@dataclass(frozen=True)
class DecodeLaunch:
    """One decode launch: `_paged_decode_kernel[grid](*args, **constants)`, then the reduce over
    `partial` and `lse` when there are splits (both None otherwise)."""

    grid: tuple[int, int, int]
    args: tuple
    constants: dict
    partial: torch.Tensor | None
    lse: torch.Tensor | None


def plan_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                max_seq_len: int, num_splits: int | None, num_sms: int,
                capability: tuple[int, int] | None, scale: float | None = None,
                layout: str = TOKEN_MAJOR, tile: int | None = None,
                prefetch_ids: bool = True, while_loop: bool | None = None) -> DecodeLaunch:
    """The launch `paged_attention_decode` makes for inputs it has checked, on any device ("meta"
    included: `kvlab.tools.compiled` compiles it without a GPU). num_splits None picks one
    (`choose_num_splits` for num_sms multiprocessors). Allocates the split buffers."""
    num_seqs, num_heads, head_dim = query.shape
    geometry = pool_geometry(k_cache, layout)
    constants = kernel_constants(query.dtype, head_dim, num_heads // geometry.num_kv_heads,
                                 geometry.block_size, max_seq_len, capability, tile, prefetch_ids,
                                 while_loop)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, geometry.num_kv_heads, max_seq_len, num_sms)
    split_len = tokens_per_split(max_seq_len, num_splits, constants["TILE"])
    num_splits = -(-max_seq_len // split_len)  # rounding to tiles may leave fewer splits
    qk_scale = (1.0 / math.sqrt(head_dim) if scale is None else scale) * math.log2(math.e)
    grid = (num_seqs, geometry.num_kv_heads, num_splits)
    inputs = (query, k_cache, v_cache, block_tables, seq_lens, qk_scale, split_len,
              *query.stride())
    pools = (block_tables.stride(0), *pool_strides(k_cache, layout), *pool_strides(v_cache, layout))
    if num_splits == 1:
        args = (out, out, *inputs, out.stride(0), out.stride(1), 0, out.stride(2), 0, 0, 0, *pools)
        return DecodeLaunch(grid, args, dict(constants, SPLIT=False), None, None)
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=query.device,
                          dtype=torch.float32)
    lse = torch.empty(num_seqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
    args = (partial, lse, *inputs, *partial.stride(), *lse.stride(), *pools)
    return DecodeLaunch(grid, args, dict(constants, SPLIT=True), partial, lse)


def paged_attention_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, layout: str = TOKEN_MAJOR,
                           num_splits: int | None = None, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None, validate: bool = True,
                           tile: int | None = None) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache (Triton).

    query [num_seqs, num_heads, head_dim] fp16, bf16 or fp32 (the output's shape and dtype; head h
    reads KV head h // group); k_cache, v_cache one layer's pools in `layout` (`pool_layout`), of
    query's dtype; block_tables [num_seqs, max_blocks_per_seq] and seq_lens [num_seqs] (>= 1, the
    new token included), int32 or int64. scale defaults to 1 / sqrt(head_dim). num_splits None picks
    one (`choose_num_splits`; 1 under the interpreter). max_seq_len, if known, saves a
    device-to-host copy and must be >= max(seq_lens). validate checks lengths and block ids on the
    host; without it a seq_len of 0 gives zeros and one past its block table gives a wrong answer,
    silently. tile: a power of two >= 16 (tests use 16).

    ValueError (with the numbers): shapes, dtypes, devices, strides, layout or lengths that do not
    fit, an `out` unlike query, bad num_splits or max_seq_len; bfloat16 on a GPU below sm_80.
    """
    check_interpreter(INTERPRETED, LANGUAGE_INTERPRETED)
    check_decode_inputs(query, k_cache, v_cache, block_tables, seq_lens, layout,
                        interpreted=INTERPRETED, validate=validate, out=out,
                        max_seq_len=max_seq_len, num_splits=num_splits)
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    capability = torch.cuda.get_device_capability(query.device) if query.is_cuda else None
    if query.is_cuda and not INTERPRETED:
        num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    else:  # the interpreter runs one program at a time: no splits unless asked for
        num_sms = 1
        num_splits = 1 if num_splits is None else num_splits
    launch = plan_decode(query, k_cache, v_cache, block_tables, seq_lens, out, max_seq_len,
                         num_splits, num_sms, capability, scale, layout, tile)
    _paged_decode_kernel[launch.grid](*launch.args, **launch.constants)
    if launch.partial is None:
        return out
    num_seqs, num_heads, num_splits, head_dim = launch.partial.shape
    _reduce_splits_kernel[(num_seqs, num_heads)](
        out, launch.partial, launch.lse, num_splits, *out.stride(), *launch.partial.stride(),
        *launch.lse.stride(), HEAD_DIM=head_dim, HEAD_DIM_PAD=launch.constants["HEAD_DIM_PAD"],
        SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out
