"""Paged decode attention in plain PyTorch: one query token per sequence of a batch.

The decode half of `kvlab.paged.torch_attention` (whose docstring has the pool, the slot mapping
and why slots a sequence does not own never reach its output): a batched decode step gathers
every sequence's K/V through its block table into one padded tensor and attends with PyTorch's
fused SDPA (vLLM paper, Kwon et al., SOSP 2023, section 4.1). The rows to read are the same for
every layer of a forward pass, so they are worked out once (`decode_gather`, as vLLM builds its
attention metadata once per step) and reused (`decode_attention`). On the CPU, a batch whose
sequences share leading blocks reads them once for all its queries (cascade attention,
`_shared_prefix_decode`), merged with each sequence's own part by their log-sum-exps.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from ..attention import kv_group_size
from ..kernels.pool_layout import TOKEN_MAJOR
from .torch_attention import _CPU_FLASH, _check_range, _merge, _pool_rows, token_major_view

__all__ = ["DecodeGather", "decode_gather", "decode_attention", "paged_decode_attention"]


@dataclasses.dataclass(frozen=True)
class DecodeGather:
    """The rows of a layer's pool (seen as [-1, head_dim]) a decode batch reads, same for every
    layer: rows [num_seqs * num_key_value_heads * num_slots] int64; score_bias [num_seqs, 1, 1,
    num_slots] float32, 0 where the sequence holds the position, -inf elsewhere (added to the
    scores); shape (num_seqs, num_key_value_heads, num_slots, head_dim), as attention reads it.
    keys, values: buffers of that shape in the pool's dtype that each layer's gather fills: one
    allocation a forward pass instead of two a layer (a decode step's are megabytes).
    shared_rows: None, or the rows of the blocks every sequence of the batch starts with, [H_kv *
    shared tokens] int64 (a shared prefix, read once for all: `_shared_prefix_decode`); `rows`
    then cover only what follows them."""

    rows: torch.Tensor
    score_bias: torch.Tensor
    shape: tuple[int, int, int, int]
    keys: torch.Tensor
    values: torch.Tensor
    shared_rows: torch.Tensor | None = None


# A shared prefix is read once when that saves at least this many token rows of copying
# ((num_seqs - 1) x its tokens). Below it the one batched gather is as fast (measured on one CPU
# thread, SmolLM2's 3 KV heads: 16 sequences sharing 64 tokens 0.52 -> 0.46 ms a layer, 8
# sharing 2,976 tokens 5.9 -> 1.1 ms; 2 sharing 128 tokens 0.055 -> 0.081 ms, slower).
SHARED_PREFIX_MIN_ROWS = 512


def _num_shared_blocks(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       block_size: int) -> int:
    """Leading blocks every sequence's table holds in common, each full in every sequence and each
    sequence left at least one token after them (its own part is never empty)."""
    same = (block_tables == block_tables[:1]).all(dim=0)  # [width]: column equal in every row
    common = int(same.long().cumprod(0).sum())
    return min(common, (int(seq_lens.min()) - 1) // block_size)


def decode_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor,
                  layout: str = TOKEN_MAJOR) -> DecodeGather:
    """The pool rows a batch of decode queries reads, from its block tables (see
    `paged_decode_attention`). ValueError: a block id outside the pool, or a seq_len outside
    [1, max_blocks_per_seq * block_size]."""
    num_seqs, width = block_tables.shape
    num_blocks, block_size, num_kv_heads, head_dim = token_major_view(k_cache, layout).shape
    _check_range("block_tables", block_tables, 0, num_blocks - 1)
    _check_range("seq_lens", seq_lens, 1, width * block_size)
    positions = torch.arange(width * block_size, device=block_tables.device)
    # Each position's slot through the block table.
    slots = block_tables[:, positions // block_size] * block_size + positions % block_size
    shared_rows, shared = None, 0  # shared: positions every sequence reads from the same slots
    if num_seqs > 1 and _CPU_FLASH is not None and k_cache.device.type == "cpu":
        shared = _num_shared_blocks(block_tables, seq_lens, block_size) * block_size
        if (num_seqs - 1) * shared >= SHARED_PREFIX_MIN_ROWS:
            shared_rows = _pool_rows(slots[:1, :shared], num_kv_heads, block_size,
                                     layout).reshape(-1)
        else:
            shared = 0
    positions, slots = positions[shared:], slots[:, shared:]
    num_slots = positions.numel()
    holds_token = positions[None, :] < seq_lens[:, None]  # [num_seqs, num_slots]
    # A position the sequence does not hold reads its own first slot instead, so no slot it does
    # not own is ever read (another request's tokens, NaN perhaps); its score is masked out, so it
    # weighs exactly 0.
    slots = torch.where(holds_token, slots, slots[:, :1])
    rows = _pool_rows(slots, num_kv_heads, block_size, layout).reshape(-1)
    score_bias = torch.zeros(num_seqs, 1, 1, num_slots, device=block_tables.device)
    score_bias.masked_fill_(~holds_token[:, None, None, :], float("-inf"))
    shape = (num_seqs, num_kv_heads, num_slots, head_dim)
    keys = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    return DecodeGather(rows, score_bias, shape, keys, torch.empty_like(keys), shared_rows)


def _gather_rows(cache: torch.Tensor, rows: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Rows of `cache.reshape(-1, head_dim)` copied into `buffer`, or into a new tensor where the
    buffer cannot serve: another dtype; autograd on (the backward pass keeps each layer's K/V,
    which the next layer would overwrite); a buffer made in inference mode, used outside it."""
    flat = cache.reshape(-1, cache.shape[-1])
    if (buffer.dtype != cache.dtype or torch.is_grad_enabled()
            or (buffer.is_inference() and not torch.is_inference_mode_enabled())):
        return flat.index_select(0, rows)
    return torch.index_select(flat, 0, rows, out=buffer.view(-1, cache.shape[-1]))


def _gathered_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
                 gather: DecodeGather) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V gathered straight into the layout attention reads, [num_seqs, H_kv, num_slots, D]:
    one index_select of head_dim-long rows of the pool each (one copy, no permute)."""
    return (_gather_rows(k_cache, gather.rows, gather.keys).view(gather.shape),
            _gather_rows(v_cache, gather.rows, gather.values).view(gather.shape))


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     gather: DecodeGather, scale: float | None = None) -> torch.Tensor:
    """`paged_decode_attention` with the rows to read already worked out (`decode_gather`)."""
    if gather.shared_rows is not None:
        return _shared_prefix_decode(query, k_cache, v_cache, gather, scale)
    num_seqs, num_kv_heads, _, head_dim = gather.shape
    num_heads = query.shape[1]
    group = kv_group_size(num_heads, num_kv_heads)
    keys, values = _gathered_kv(k_cache, v_cache, gather)
    # One batched attention for all sequences, GQA by grouping as in `grouped_attention`: query
    # head h = kv * G + g reads KV head kv, so the G heads of a group are G query rows over the
    # same keys. A sequence's one query sits at its last position, so causality is just the
    # positions it holds (`score_bias`). PyTorch's fused SDPA does scores, mask, softmax and the
    # weighted sum in one call, in float32.
    grouped_q = query.reshape(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(grouped_q.float(), keys.float(), values.float(),
                                         attn_mask=gather.score_bias, scale=scale)  # [S,H_kv,G,D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _shared_prefix_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          gather: DecodeGather, scale: float | None) -> torch.Tensor:
    """Decode attention of a batch whose sequences all start with the same blocks (a cached system
    prompt or document): the shared blocks are copied once, and all the batch's queries attend to
    them in one call (each KV head's S * G query rows over the same keys, one matrix product
    instead of S); each sequence's own blocks as `decode_attention` reads them; the two halves
    merged by their log-sum-exps (as `_earlier_then_own`). Cascade attention: Hydragen (Juravsky
    et al., 2024, section 3) and FlashInfer's cascade inference; it saves the batch's copies of
    the prefix, (S - 1) x its bytes a layer."""
    num_seqs, num_kv_heads, _, head_dim = gather.shape
    num_heads = query.shape[1]
    group = kv_group_size(num_heads, num_kv_heads)
    grouped_q = query.reshape(num_seqs, num_kv_heads, group, head_dim).float()
    # The prefix: [1, H_kv, shared tokens, D] once; every sequence's G query rows of a KV head
    # stacked into S * G rows of one head.
    shared_k, shared_v = (cache.reshape(-1, head_dim).index_select(0, gather.shared_rows)
                          .view(1, num_kv_heads, -1, head_dim).float() for cache in (k_cache, v_cache))
    stacked_q = grouped_q.transpose(0, 1).reshape(1, num_kv_heads, num_seqs * group, head_dim)
    shared, shared_lse = _CPU_FLASH(stacked_q, shared_k, shared_v, scale=scale)
    shared = shared.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1)
    shared_lse = shared_lse.view(num_kv_heads, num_seqs, group).transpose(0, 1)
    # Each sequence's own blocks, masked as in `decode_attention`.
    own_k, own_v = (x.float() for x in _gathered_kv(k_cache, v_cache, gather))
    own, own_lse = _CPU_FLASH(grouped_q, own_k, own_v, attn_mask=gather.score_bias, scale=scale)
    out, _ = _merge(shared, shared_lse, own, own_lse)  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, layout: str = TOKEN_MAJOR) -> torch.Tensor:
    """One query token per sequence, each attending over its own blocks (a batched decode step).

    Padding entries of the block tables are real block ids (`PagedKVCache.PAD_BLOCK_ID`), so only
    `seq_lens` says which slots are a sequence's; `decode_gather` keeps the others out, weight 0.

    query [num_seqs, num_attention_heads, head_dim] is the token at position seq_len - 1 of each
    sequence (its K/V already written), and the output has its shape and dtype; block_tables
    [num_seqs, max_blocks_per_seq] int64, padded; seq_lens [num_seqs] int64; scale defaults to
    1 / sqrt(head_dim). ValueError: a block id outside the pool, or a seq_len outside
    [1, max_blocks_per_seq * block_size] (a sequence with no token has nothing to attend to).
    """
    return decode_attention(query, k_cache, v_cache,
                            decode_gather(block_tables, seq_lens, k_cache, layout), scale)
