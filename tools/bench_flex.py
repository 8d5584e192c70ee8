"""FlexAttention as stage 5's peer over the same paged pool, with the block mask that suits it best.

FlexAttention (torch.nn.attention.flex_attention) tiles the key axis into mask blocks of
`BLOCK_SIZE[1]` slots; a block mask lists, per sequence, the mask blocks it visits, "full" ones
(every slot kept: the mask_mod is not evaluated) and "partial" ones (loaded whole, then masked
slot by slot). Over a paged pool viewed as one key sequence of num_blocks x block_size slots, a
sequence must visit every mask block that holds one of its pool blocks.

With the default 128-slot mask blocks and pool blocks of 16, each mask block holds 8 pool blocks,
shuffled among the sequences, so a sequence visits nearly every mask block that holds one of its
own: at batch 64 x 4,096 tokens, 7.58 tokens loaded per token owned (1.99 at block 64). With mask
blocks as large as the pool's blocks, a sequence visits exactly its own blocks: 1.0 when seq_len
is a multiple of block_size. PyTorch's paged helper makes the same choice
(`torch.nn.attention.experimental._paged_attention.PagedAttention.convert_logical_block_mask`
requires the mask's column block size to equal its page size, and maps each sequence's logical
blocks to physical ones through its page table); `paged_block_mask` builds that mask from the
block table directly, in O(batch x blocks), where `create_block_mask` would evaluate the mask_mod
at every (sequence, slot) of the pool. `visited_per_owned` counts what a mask makes FlexAttention
load.
"""

from __future__ import annotations

import torch

__all__ = ["owned_tokens", "paged_mask_mod", "paged_block_mask", "visited_per_owned",
           "flex_paged"]


def owned_tokens(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """Tokens of each sequence in each of its table entries: [batch, width] int64, block_size for
    a full block, the remainder for the last one, 0 for padding past seq_len."""
    starts = torch.arange(block_tables.shape[1], device=block_tables.device) * block_size
    return (seq_lens.long()[:, None] - starts).clamp(0, block_size)


def paged_mask_mod(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                   num_blocks: int):
    """mask_mod(b, h, q_idx, kv_idx): True when pool slot kv_idx holds one of sequence b's tokens
    (its block is in b's table at logical position < seq_len), through a physical-to-logical map
    (owner and rank of every pool block) as PagedAttention.get_mask_mod does."""
    device = block_tables.device
    batch, width = block_tables.shape
    used = owned_tokens(block_tables, seq_lens, block_size) > 0
    owner = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
    rank = torch.zeros(num_blocks, dtype=torch.long, device=device)
    owner[block_tables[used].long()] = torch.arange(batch, device=device)[:, None].expand(
        batch, width)[used]
    rank[block_tables[used].long()] = torch.arange(width, device=device).expand(batch, width)[used]
    lens = seq_lens.long()

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        return (owner[block] == b) & (rank[block] * block_size + kv_idx % block_size < lens[b])

    return mask_mod


def _listed(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per row [B, 1, 1] int32, the selected columns first in ascending order [B, 1, 1, N]
    int32) of a [B, N] bool: BlockMask's kv_num_blocks and kv_indices."""
    order = torch.sort((~selected).to(torch.int8), dim=1, stable=True).indices
    return (selected.sum(1).to(torch.int32)[:, None, None],
            order.to(torch.int32)[:, None, None, :])


def paged_block_mask(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     num_blocks: int, mask_block_size: int | None = None):
    """FlexAttention's BlockMask over a pool of num_blocks x block_size slots for one query token
    per sequence, with mask blocks of mask_block_size slots (default block_size; a multiple of
    it). block_tables [batch, width] int, seq_lens [batch] int. ValueError: mask_block_size not a
    positive multiple of block_size."""
    from torch.nn.attention.flex_attention import BlockMask

    mask_block_size = mask_block_size or block_size
    if mask_block_size < block_size or mask_block_size % block_size:
        raise ValueError(f"mask_block_size {mask_block_size} must be a multiple of the pool's "
                         f"block_size {block_size}")
    per_mask_block = mask_block_size // block_size
    num_slots = num_blocks * block_size
    num_mask_blocks = -(-num_slots // mask_block_size)
    tokens = owned_tokens(block_tables, seq_lens, block_size)
    owned = torch.zeros(block_tables.shape[0], num_mask_blocks, dtype=torch.long,
                        device=block_tables.device)
    owned.scatter_add_(1, block_tables.long() // per_mask_block, tokens)
    slots = (num_slots - torch.arange(num_mask_blocks, device=owned.device)
             * mask_block_size).clamp(max=mask_block_size)  # the last one may be shorter
    full = owned == slots
    partial = (owned > 0) & ~full
    kv_num_blocks, kv_indices = _listed(partial)
    full_num_blocks, full_indices = _listed(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_num_blocks, full_indices,
        BLOCK_SIZE=(128, mask_block_size),
        mask_mod=paged_mask_mod(block_tables, seq_lens, block_size, num_blocks),
        seq_lengths=(1, num_slots))


def visited_per_owned(mask, seq_lens: torch.Tensor) -> float:
    """Key slots FlexAttention loads under `mask` (every visited mask block, whole) per token the
    batch owns (sum of seq_lens)."""
    visited = mask.kv_num_blocks.sum()
    if mask.full_kv_num_blocks is not None:
        visited = visited + mask.full_kv_num_blocks.sum()
    return float(visited) * mask.BLOCK_SIZE[1] / float(seq_lens.sum())


def flex_paged(point: dict, device: torch.device, mask_block_size: int | None = None):
    """FlexAttention over a benchmark point's token-major pool (`make_point`), read through its
    shuffled block table with `paged_block_mask`. Returns (zero-argument callable giving [batch,
    num_heads, head_dim], the mask). Raises where this torch has no FlexAttention."""
    from torch.nn.attention.flex_attention import flex_attention

    k_cache = point["k_cache"]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    mask = paged_block_mask(point["shuffled"], point["seq_lens"], block_size, num_blocks,
                            mask_block_size)
    slots = num_blocks * block_size
    keys = k_cache.view(slots, num_kv_heads, head_dim).transpose(0, 1)[None]
    values = point["v_cache"].view(slots, num_kv_heads, head_dim).transpose(0, 1)[None]
    query = point["query"][:, :, None, :]
    attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    return lambda: attend(query, keys, values, block_mask=mask, enable_gqa=True)[:, :, 0], mask
