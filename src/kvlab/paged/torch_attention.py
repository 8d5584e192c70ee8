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
  `kvlab.paged.torch_decode.paged_decode_attention` for one query token of each of a batch of
  sequences, with its own module (vLLM paper, Kwon
  et al., SOSP 2023, section 4.1, equation 4: attention computed block by block over a block table).
  The attention is stage 3's (`kvlab.attention.grouped_attention`: causal, GQA by grouping, float32
  softmax) computed by PyTorch's fused SDPA, which never builds the [heads, queries, keys] scores
  in memory. In torch 2.13 (the CPU build this course installs) its CPU flash kernel takes the
  grouped heads and the mask as they are, checked; an older torch may compute the same numbers on
  its slower math path. Measured on the engine's prefills: docs/vllm_comparison.md, section 9.

This implementation copies the blocks into a contiguous tensor before attending; a real kernel
reads them in place, block by block. Same numbers, less memory traffic: that is stage 5.

Every function takes the pool's `layout` (`kvlab.kernels.pool_layout`): "token-major" (above, the
default) or "head-major", [num_blocks, num_key_value_heads, block_size, head_dim]. A head-major
pool is read through its token-major view (`token_major_view`, a transpose: no copy).

Slots a sequence does not own (past its seq_len in its last block, or in the padding of its block
table) may hold anything another request left there, NaN included, so they can never reach the
output: prefill gathers only the seq_len tokens the sequence holds (every one written before the
attention runs), decode never reads them (`kvlab.paged.torch_decode`).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..attention import causal_mask, kv_group_size
from ..kernels.pool_layout import TOKEN_MAJOR, check_layout

__all__ = ["write_kv", "gather_kv", "paged_prefill_attention", "token_major_view"]


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
# A later chunk is split into earlier keys and its own only from this many earlier tokens: below
# it, two calls and a merge cost what the mask saves (one CPU thread, SmolLM2's shapes, a
# 256-token chunk alone: 0.9x at 256 earlier keys, equal at 768, 1.6x faster at 1,792, 1.4x at
# 3,744; the six long prompts through the engine, splitting from 1 or from 1,024: within 3 %).
SPLIT_MIN_EARLIER = 512


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


# PyTorch's CPU flash-attention kernel, the one SDPA calls on the CPU, called directly because it
# also returns each row's log-sum-exp of scores (`_earlier_then_own`). Absent: the masked SDPA.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _as_heads(rows: torch.Tensor) -> torch.Tensor:
    """[n, H_kv, D] pool rows -> [1, H_kv, n, D] float32, as attention reads them (a view)."""
    return rows.transpose(0, 1).float()[None]


def _earlier_then_own(q: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]],
                      start: int, scale: float | None) -> torch.Tensor:
    """Causal attention of a chunk at positions start .. start + T - 1 as unmasked and causal
    parts merged by their log-sum-exps (the split-KV reduction of stage 5b, flash-decoding):
    every query sees all `start` earlier keys, so they need no mask (read piece by piece, in
    place), and the chunk's own T keys are SDPA's plain causal case. A [T, seq_len] mask costs the
    CPU kernel ~20 % of its time at 4,000 keys; the split pays small merges instead. For the
    earlier keys, the G query heads of each KV head are stacked into one head of G * T rows: the
    same keys, fewer and larger matrix products. q [1, H, T, D] float32 -> [1, H, T, D]."""
    _, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = pieces[0][0].shape[1]
    stacked = q.reshape(1, num_kv_heads, num_heads // num_kv_heads * num_tokens, head_dim)
    earlier = None
    for k, v in _positions(pieces, 0, start):
        part = _CPU_FLASH(stacked, _as_heads(k), _as_heads(v), scale=scale)
        earlier = part if earlier is None else _merge(*earlier, *part)
    own_k, own_v = _joined(_positions(pieces, start, start + num_tokens))
    own = _CPU_FLASH(q, _as_heads(own_k), _as_heads(own_v), is_causal=True, scale=scale)
    out, _ = _merge(earlier[0].reshape(q.shape), earlier[1].reshape(own[1].shape), *own)
    return out


def _merge(first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor,
           second_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys merged into attention over their union, and its
    log-sum-exp. Each output is softmax-weighted within its own keys, so it weighs its share of
    the whole exp-sum: the second's share is e^b / (e^a + e^b) = sigmoid(b - a) for log-sum-exps
    a, b (shaped as the outputs without their last dim)."""
    share = torch.sigmoid(second_lse - first_lse).unsqueeze(-1)
    return torch.lerp(first, second, share), torch.logaddexp(first_lse, second_lse)


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
    if start >= SPLIT_MIN_EARLIER and _CPU_FLASH is not None and q.device.type == "cpu":
        out = _earlier_then_own(q, pieces, start, scale)
    else:
        k, v = (_as_heads(x) for x in _joined(pieces))
        visible = None if start == 0 else causal_mask(
            positions, torch.arange(seq_len, device=query.device))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=start == 0,
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)  # [num_tokens, num_attention_heads, head_dim]
