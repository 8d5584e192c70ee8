"""Stage 5: a Triton kernel that stores new keys and values into the block pool at the slot mapping.

Token i's K/V go to slot `slot_mapping[i]` = block_id * block_size + offset (stage 4); -1 means
"do not store", as for the padding tokens of vLLM's `reshape_and_cache`, so a padded batch needs no
compaction. Either pool layout works (strides by meaning, `kvlab.kernels.pool_layout`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import INTERPRETED, LANGUAGE_INTERPRETED
from .pool_layout import TOKEN_MAJOR, pool_strides
from .validate import check_interpreter, check_write_inputs

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slot_mapping_ptr,
                     stride_key_t, stride_key_h, stride_key_d,
                     stride_value_t, stride_value_h, stride_value_d,
                     stride_kb, stride_kt, stride_kh, stride_kd,
                     stride_vb, stride_vt, stride_vh, stride_vd,
                     NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    """Grid (num_tokens,): all KV heads of one token, written to one slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    keep = (slot + tl.zeros([HEADS_PAD], tl.int64)) >= 0  # a vector: the interpreter wants one
    mask = (keep & (offs_h < NUM_KV_HEADS))[:, None] & (offs_d < HEAD_DIM)[None, :]
    key = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h
                  + offs_d[None, :] * stride_key_d, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h
                    + offs_d[None, :] * stride_value_d, mask=mask)
    tl.store(k_cache_ptr + block_id * stride_kb + offset * stride_kt
             + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, key, mask=mask)
    tl.store(v_cache_ptr + block_id * stride_vb + offset * stride_vt
             + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, value, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor, layout: str = TOKEN_MAJOR,
             validate: bool = True) -> None:
    """Store key, value [num_tokens, num_kv_heads, head_dim] (the pool's dtype) in place at
    slot_mapping [num_tokens] (int32 or int64). validate checks the slots on the host. ValueError:
    shapes, dtypes or devices that do not fit; a slot below -1 or past the pool."""
    check_interpreter(INTERPRETED, LANGUAGE_INTERPRETED)
    geometry = check_write_inputs(key, value, k_cache, v_cache, slot_mapping, layout,
                                  interpreted=INTERPRETED, validate=validate)
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        k_cache, v_cache, key, value, slot_mapping, *key.stride(), *value.stride(),
        *pool_strides(k_cache, layout), *pool_strides(v_cache, layout),
        NUM_KV_HEADS=geometry.num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(geometry.num_kv_heads),
        HEAD_DIM=geometry.head_dim, HEAD_DIM_PAD=triton.next_power_of_2(geometry.head_dim),
        BLOCK_SIZE=geometry.block_size)
