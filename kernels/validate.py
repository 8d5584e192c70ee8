"""Input checks of the stage-5 kernels, on the host, with the numbers in every message (no Triton).

A kernel handed a wrong shape does not fail: it reads whatever the wrong strides point at. So each
launch wrapper first checks what would otherwise give a silent wrong answer: shapes, dtypes,
devices, assumed strides, the output, the split count, and (unless validate=False, since it reads
device tensors on the host) block ids and lengths. No check can see a layout: a head-major pool
read as token-major is refused only when its sizes do not fit (messages name the layout read), so
`PagedKVCache` records its pool's layout and `resolve_backend` refuses a backend of the other one.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .pool_layout import TOKEN_MAJOR, check_layout

__all__ = ["PoolGeometry", "pool_geometry", "check_device", "check_interpreter", "check_decode_inputs",
           "check_write_inputs", "check_count", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class PoolGeometry:
    """Sizes of one layer's pool, whichever layout it is in."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def pool_geometry(pool: torch.Tensor, layout: str) -> PoolGeometry:
    """Read (num_blocks, block_size, num_kv_heads, head_dim) off a pool tensor in `layout`."""
    check_layout(layout)
    if pool.dim() != 4:
        raise ValueError(f"a block pool is 4-d, got shape {tuple(pool.shape)}")
    num_blocks, a, b, head_dim = pool.shape
    block_size, num_kv_heads = (a, b) if layout == TOKEN_MAJOR else (b, a)
    return PoolGeometry(num_blocks, block_size, num_kv_heads, head_dim)


def check_device(tensor: torch.Tensor, interpreted: bool) -> None:
    """ValueError: an unsupported dtype, CPU tensors without TRITON_INTERPRET=1, bf16 below sm_80."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {tensor.dtype} not supported: use float16, bfloat16 or float32")
    if tensor.is_cuda:
        major, minor = torch.cuda.get_device_capability(tensor.device)
        if tensor.dtype == torch.bfloat16 and major < 8:
            name = torch.cuda.get_device_name(tensor.device)
            raise ValueError(f"bfloat16 needs compute capability >= 8.0; {name} has "
                             f"{major}.{minor}: use float16")
    elif not interpreted:
        raise ValueError(f"tensors are on {tensor.device}: the Triton kernels need a CUDA GPU, or "
                         "TRITON_INTERPRET=1 set before triton is first imported (CPU interpreter)")


def check_interpreter(kernels_interpreted: bool, language_interpreted: bool) -> None:
    """ValueError: TRITON_INTERPRET=1 set after Triton was first imported (Triton's helpers are
    then compiled-mode functions the interpreted kernels cannot call)."""
    if kernels_interpreted and not language_interpreted:
        raise ValueError("TRITON_INTERPRET=1 was set after Triton was first imported (torch "
                         "imports it, e.g. when a model is loaded): set it before importing torch")


def _check_index_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")


def _check_vector(name: str, tensor: torch.Tensor) -> None:
    """The kernels read element i at `ptr + i`: a strided view would give them other numbers."""
    if tensor.numel() > 1 and tensor.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {tensor.stride(0)}: "
                         "call .contiguous()")


def check_count(name: str, value, low: int = 1) -> int:
    """`value` as an int >= low; ValueError naming it otherwise (floats and bools included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _read_as(layout: str) -> str:
    order = "block_size, num_kv_heads" if layout == TOKEN_MAJOR else "num_kv_heads, block_size"
    return f"the pool read as {layout} [num_blocks, {order}, head_dim]"


def check_decode_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, layout: str,
                        interpreted: bool, validate: bool = True,
                        out: torch.Tensor | None = None, max_seq_len: int | None = None,
                        num_splits: int | None = None) -> PoolGeometry:
    """Everything `paged_attention_decode` needs before it launches; returns the pool geometry."""
    geometry = pool_geometry(k_cache, layout)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got {tuple(query.shape)}")
    num_seqs, num_heads, head_dim = query.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if geometry.head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != pool head_dim {geometry.head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} not supported (1 to {MAX_HEAD_DIM})")
    if num_heads % geometry.num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over "
                         f"{geometry.num_kv_heads} KV heads ({_read_as(layout)})")
    if not query.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: query {query.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks_per_seq], got "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    _check_index_dtype("block_tables", block_tables)
    _check_index_dtype("seq_lens", seq_lens)
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous (call .contiguous())")
    _check_vector("seq_lens", seq_lens)
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} like query, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if max_seq_len is not None:
        check_count("max_seq_len", max_seq_len)
    if num_splits is not None:
        check_count("num_splits", num_splits)
    inputs = (query, k_cache, v_cache, block_tables, seq_lens) + (() if out is None else (out,))
    devices = {t.device for t in inputs}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    check_device(query, interpreted)
    if validate and num_seqs:
        _check_lengths(seq_lens, block_tables.shape[1], geometry.block_size, layout, max_seq_len)
        low, high = int(block_tables.min()), int(block_tables.max())
        if low < 0 or high >= geometry.num_blocks:
            raise ValueError(f"block ids must be in 0..{geometry.num_blocks - 1}, got {low}..{high}")
    return geometry


def _check_lengths(seq_lens: torch.Tensor, width: int, block_size: int, layout: str,
                   max_seq_len: int | None) -> None:
    """1 <= seq_len <= width * block_size, and max_seq_len (which sizes the splits) >= each."""
    capacity = width * block_size
    shortest, longest = int(seq_lens.min()), int(seq_lens.max())
    if shortest < 1 or longest > capacity:
        worst = shortest if shortest < 1 else longest
        index = int((seq_lens == worst).nonzero()[0])
        raise ValueError(f"seq_lens must be in 1..{capacity} (block table width {width} x "
                         f"block_size {block_size}, {_read_as(layout)}), got {worst} for "
                         f"sequence {index}")
    if max_seq_len is not None and max_seq_len < longest:
        index = int((seq_lens == longest).nonzero()[0])
        raise ValueError(f"max_seq_len {max_seq_len} is below the longest seq_len {longest} "
                         f"(sequence {index}): the kernel sizes its splits from max_seq_len and "
                         "would leave that sequence's last tokens out; pass max(seq_lens), or "
                         "None to have it computed")


def check_write_inputs(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str,
                       interpreted: bool, validate: bool = True) -> PoolGeometry:
    """Everything `write_kv` needs before it launches."""
    geometry = pool_geometry(k_cache, layout)
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1,
                geometry.num_kv_heads, geometry.head_dim)
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be [num_tokens], got {tuple(slot_mapping.shape)}")
    if tuple(key.shape) != expected or value.shape != key.shape:
        raise ValueError(f"key and value must be {list(expected)} for this pool and slot mapping, "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: key {key.dtype}, value {value.dtype}, "
                         f"pool {k_cache.dtype} / {v_cache.dtype}")
    _check_index_dtype("slot_mapping", slot_mapping)
    _check_vector("slot_mapping", slot_mapping)
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    check_device(key, interpreted)
    if validate and slot_mapping.numel():
        num_slots = geometry.num_blocks * geometry.block_size
        low, high = int(slot_mapping.min()), int(slot_mapping.max())
        if low < -1 or high >= num_slots:
            raise ValueError(f"slots must be -1 (skip) or in 0..{num_slots - 1}, got "
                             f"{low}..{high}")
    return geometry
