"""Paged attention in plain PyTorch: the stage-4 teaching implementation, and the default backend.

Code to read, not a test oracle (that is `kvlab.oracles`, SDPA in float64): the paged cache runs
it through `TorchBackend`, and the stage-5 Triton kernel is checked against it.

The pool of one layer is a tensor [num_blocks, block_size, num_key_value_heads, head_dim]. Seen
flat, [num_blocks * block_size, num_key_value_heads, head_dim], its row `slot` is the token slot
block_id * block_size + offset. Three operations cover a forward pass:

* `write_kv`: scatter this step's K/V into their slots (the slot mapping). vLLM's
  `reshape_and_cache` kernel does this.
* gather, then attend: read a sequence's K/V back through its block table and run ordinary
  attention over it. `paged_prefill_attention` does this for many query tokens of one sequence,
  `paged_decode_attention` for one query token of each of a batch of sequences (vLLM paper, Kwon
  et al., SOSP 2023, section 4.1, equation 4: attention computed block by block over a block table).
  The attention is stage 3's (`kvlab.attention.grouped_attention`: causal, GQA by grouping, float32
  softmax) computed by PyTorch's fused SDPA, which never builds the [heads, queries, keys] scores
  in memory. In torch 2.13 (the CPU build this course installs) its CPU flash kernel takes the
  grouped heads and the mask as they are, checked; an older torch may compute the same numbers on
  its slower math path. Measured on the engine's prefills: docs/vllm_comparison.md, section 9.
  On the CPU, a long prompt's later chunks and a decode batch over a shared prefix attend in two
  parts merged by their log-sum-exps (`kvlab.paged.split_prefill`).

This implementation copies the blocks into a contiguous tensor before attending; a real kernel
reads them in place, block by block. Same numbers, less memory traffic: that is stage 5.

Every function takes the pool's `layout` (`kvlab.kernels.pool_layout`): "token-major" (above, the
default) or "head-major", [num_blocks, num_key_value_heads, block_size, head_dim]. A head-major
pool is read through its token-major view (`token_major_view`, a transpose: no copy).

Slots a sequence does not own (past its seq_len in its last block, or in the padding of its block
table) may hold anything another request left there, NaN included, so they can never reach the
output: prefill gathers only the seq_len tokens the sequence holds (every one written before the
attention runs), decode never reads them (`paged_decode_attention`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from ..attention import causal_mask, kv_group_size
from ..kernels.pool_layout import TOKEN_MAJOR, check_layout
from . import split_prefill
from .split_prefill import earlier_then_own, merge_attention

__all__ = ["write_kv", "gather_kv", "paged_prefill_attention", "paged_decode_attention",
           "DecodeGather", "decode_gather", "decode_attention", "token_major_view"]


def _check_range(name: str, values: torch.Tensor, low: int, high: int) -> None:
    """ValueError naming the first entry outside [low, high]. The teaching path checks what a
    kernel would trust: a negative slot or block id would index from the end of the pool, a seq_len
    past a block table would silently read fewer tokens (one host sync; stage 5's kernel skips it).
    """
    if values.numel() == 0:
        return
    smallest, largest = (int(v) for v in torch.aminmax(values))  # one pass, two numbers back
    if smallest < low or largest > high:
        bad = (values < low) | (values > high)
        raise ValueError(f"{name} must be in [{low}, {high}], got {int(values[bad][0])}")


def _pool_rows(slots: torch.Tensor, num_kv_heads: int, block_size: int,
               layout: str) -> torch.Tensor:
    """Row of `pool.reshape(-1, head_dim)` holding (slot, KV head): slots [num_seqs, n] int64 ->
    rows [num_seqs, num_key_value_heads, n]."""
    heads = torch.arange(num_kv_heads, device=slots.device)[None, :, None]
    if check_layout(layout) == TOKEN_MAJOR:  # [block, offset, head, :]: slot-major
        return slots[:, None, :] * num_kv_heads + heads
    blocks, offsets = slots // block_size, slots % block_size  # [block, head, offset, :]
    return (blocks[:, None, :] * num_kv_heads + heads) * block_size + offsets[:, None, :]


def token_major_view(pool: torch.Tensor, layout: str = TOKEN_MAJOR) -> torch.Tensor:
    """The pool as [num_blocks, block_size, num_key_value_heads, head_dim]: itself, or (for a
    head-major pool) a transposed view of the same memory. Raises ValueError for an unknown layout."""
    return pool if check_layout(layout) == TOKEN_MAJOR else pool.transpose(1, 2)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, layout: str = TOKEN_MAJOR) -> None:
    """Store token i's key and value at slot `slot_mapping[i]` of one layer's pool (in place).

    key, value: [num_tokens, num_key_value_heads, head_dim], the cache's dtype; slot_mapping:
    [num_tokens] int64. ValueError: a slot outside [0, num_blocks * block_size).
    """
    num_blocks, block_size = token_major_view(k_cache, layout).shape[:2]
    _check_range("slot_mapping", slot_mapping, 0, num_blocks * block_size - 1)
    if check_layout(layout) == TOKEN_MAJOR:
        num_kv_heads, head_dim = k_cache.shape[2:]
        # A view, not a copy: writing into the flat view writes into the pool.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
        return
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, offsets] = key      # [num_tokens, H_kv, D] lands in [block, :, offset]
    v_cache[blocks, :, offsets] = value


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              layout: str = TOKEN_MAJOR) -> torch.Tensor:
    """One sequence's keys (or values) in position order, copied out of its blocks: block_table
    [num_blocks_of_sequence] int64 -> a new [seq_len, num_key_value_heads, head_dim] tensor.
    ValueError: a block id outside the pool, or seq_len outside [0, len(block_table) * block_size].
    """
    cache = token_major_view(cache, layout)
    _check_sequence(block_table, seq_len, *cache.shape[:2])
    blocks = cache[block_table]  # [n, block_size, H_kv, D]: advanced indexing copies
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _check_sequence(block_table: torch.Tensor, seq_len: int, num_blocks: int,
                    block_size: int) -> None:
    """ValueError for a block id outside the pool, or seq_len outside what the table holds."""
    _check_range("block_table", block_table, 0, num_blocks - 1)
    _check_range("seq_len", torch.tensor([seq_len]), 0, block_table.numel() * block_size)


# A sequence whose blocks form more runs of consecutive ids than this is copied whole instead
# (one flash call per run of earlier keys would cost more than the copy).
MAX_RUNS = 8


def _sequence_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int, layout: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`gather_kv` of keys and values, checked once, as consecutive pieces ([n, H_kv, D] each) in
    position order: in a token-major pool, a view of each run of consecutive block ids (a fresh
    pool hands blocks out in order; a prefix-cache hit is one run, the blocks after it another);
    past `MAX_RUNS` runs, or in a head-major pool, one copy."""
    pools = [token_major_view(pool, layout) for pool in (k_cache, v_cache)]
    num_blocks, block_size, num_kv_heads, head_dim = pools[0].shape
    _check_sequence(block_table, seq_len, num_blocks, block_size)
    table = block_table.tolist()
    runs_start = [i for i in range(len(table)) if i == 0 or table[i] != table[i - 1] + 1]
    if check_layout(layout) != TOKEN_MAJOR or not runs_start or len(runs_start) > MAX_RUNS:
        keys, values = (pool[block_table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
                        for pool in pools)  # advanced indexing copies
        return [(keys, values)]
    pieces = []
    for run, end in zip(runs_start, runs_start[1:] + [len(table)]):
        first_token = run * block_size
        if first_token >= seq_len:
            break
        k, v = (pool[table[run]:table[run] + end - run].reshape(-1, num_kv_heads, head_dim)
                for pool in pools)  # views of the same memory
        pieces.append((k[:seq_len - first_token], v[:seq_len - first_token]))
    return pieces


def _positions(pieces: list[tuple[torch.Tensor, torch.Tensor]], begin: int,
               end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The parts of `pieces` (consecutive, from position 0) that hold positions begin .. end - 1."""
    out, offset = [], 0
    for k, v in pieces:
        lo, hi = max(begin - offset, 0), min(end - offset, k.shape[0])
        if lo < hi:
            out.append((k[lo:hi], v[lo:hi]))
        offset += k.shape[0]
    return out


def _joined(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces as one keys and one values tensor: the piece itself if there is one (a view)."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([k for k, _ in pieces]), torch.cat([v for _, v in pieces])


def _as_heads(rows: torch.Tensor) -> torch.Tensor:
    """[n, H_kv, D] pool rows -> [1, H_kv, n, D] float32, as attention reads them (a view)."""
    return rows.transpose(0, 1).float()[None]


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_len: int,
                            query_positions: torch.Tensor, scale: float | None = None,
                            layout: str = TOKEN_MAJOR) -> torch.Tensor:
    """Causal attention of many query tokens of one sequence over its blocks (prefill).

    The query tokens are the sequence's last num_tokens (the whole sequence, or its part after a
    recompute, a prefix-cache hit in stage 6 or an earlier chunk), their own K/V already written
    (`write_kv`). query [num_tokens, num_attention_heads, head_dim] -> the same shape, query's
    dtype; query_positions [num_tokens] int64, seq_len - num_tokens .. seq_len - 1; scale defaults
    to 1 / sqrt(head_dim). ValueError: as `gather_kv`, other query positions, uneven head groups
    or unequal head_dims.
    """
    num_tokens, num_heads, head_dim = query.shape
    start = seq_len - num_tokens
    positions = torch.arange(start, seq_len, device=query_positions.device)
    if not torch.equal(query_positions, positions):
        raise ValueError(f"query_positions must be the sequence's last {num_tokens}, "
                         f"{start} .. {seq_len - 1}, got {query_positions.tolist()[:8]}")
    pieces = _sequence_kv(k_cache, v_cache, block_table, seq_len, layout)  # [n, H_kv, D] each
    kv_group_size(num_heads, pieces[0][0].shape[1])
    if pieces[0][0].shape[2] != head_dim:
        raise ValueError(f"head_dim mismatch: query {tuple(query.shape)}, pool rows "
                         f"{tuple(pieces[0][0].shape[1:])}")
    # Stage 3's `grouped_attention` in one fused call (module docstring): a query at position p
    # sees keys 0 .. p, and query head h reads KV head h // G (enable_gqa). A whole sequence is
    # SDPA's own causal case; a later part sees every earlier key, so it needs the mask, or (on
    # the CPU, past SPLIT_MIN_EARLIER earlier keys) the split into earlier keys and its own.
    q = query.transpose(0, 1).float()[None]
    if (start >= split_prefill.SPLIT_MIN_EARLIER and split_prefill.CPU_FLASH is not None
            and q.device.type == "cpu"):
        earlier = [(_as_heads(k), _as_heads(v)) for k, v in _positions(pieces, 0, start)]
        own_k, own_v = (_as_heads(x) for x in _joined(_positions(pieces, start, seq_len)))
        out = earlier_then_own(q, earlier, own_k, own_v, scale)
    else:
        k, v = (_as_heads(x) for x in _joined(pieces))
        visible = None if start == 0 else causal_mask(
            positions, torch.arange(seq_len, device=query.device))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=start == 0,
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)  # [num_tokens, num_attention_heads, head_dim]


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
    if num_seqs > 1 and split_prefill.CPU_FLASH is not None and k_cache.device.type == "cpu":
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


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     gather: DecodeGather, scale: float | None = None) -> torch.Tensor:
    """`paged_decode_attention` with the rows to read already worked out (`decode_gather`)."""
    if gather.shared_rows is not None:
        return _shared_prefix_decode(query, k_cache, v_cache, gather, scale)
    num_seqs, num_kv_heads, _, head_dim = gather.shape
    num_heads = query.shape[1]
    group = kv_group_size(num_heads, num_kv_heads)
    # Gather K and V straight into the layout attention reads, [num_seqs, H_kv, num_slots, D]:
    # one index_select of head_dim-long rows of the pool (one copy, no permute).
    keys = _gather_rows(k_cache, gather.rows, gather.keys).view(gather.shape)
    values = _gather_rows(v_cache, gather.rows, gather.values).view(gather.shape)
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
    merged by their log-sum-exps (as `earlier_then_own`). Cascade attention: Hydragen (Juravsky
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
    shared, shared_lse = split_prefill.CPU_FLASH(stacked_q, shared_k, shared_v, scale=scale)
    shared = shared.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1)
    shared_lse = shared_lse.view(num_kv_heads, num_seqs, group).transpose(0, 1)
    # Each sequence's own blocks, masked as in `decode_attention`.
    own_k = _gather_rows(k_cache, gather.rows, gather.keys).view(gather.shape).float()
    own_v = _gather_rows(v_cache, gather.rows, gather.values).view(gather.shape).float()
    own, own_lse = split_prefill.CPU_FLASH(grouped_q, own_k, own_v, attn_mask=gather.score_bias,
                                           scale=scale)
    out, _ = merge_attention(shared, shared_lse, own, own_lse)  # [S, H_kv, G, D]
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
