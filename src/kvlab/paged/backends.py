"""Attention backends: the one seam where a faster paged-attention kernel plugs into the cache.

A backend (`AttentionBackend`) is any object with three methods over one layer's pool tensors
(`k_cache`, `v_cache`: [num_blocks, block_size, num_key_value_heads, head_dim]): `write_kv` stores
each new token's K/V at its slot; `prefill` is causal attention of many tokens of one sequence
over its blocks; `decode` attends one query token per sequence of a batch over its own blocks.

vLLM splits its code the same way (an attention backend per kernel family, chosen at start-up; the
paper's section 4.1 kernel is one of them). `PagedKVCache(..., attention_backend=...)` takes a
backend object or a name; `TorchBackend` (`kvlab.paged.torch_attention`) is the default, and
stage 5 adds a Triton kernel as one more entry of `BACKENDS`.

A backend reads pools of one layout, its `layout` attribute (token-major by default,
`kvlab.kernels.pool_layout`); factories take the layout, and the cache allocates its pool in it.

Contract every backend keeps (tests/test_poisoned_pool.py holds each backend to it): shapes and
dtypes as documented on `TorchBackend`; slots a sequence does not own, past its seq_len or in the
padding of its block table, never reach its output, even when they hold NaN or Inf.
"""

from __future__ import annotations

from typing import Callable, Protocol, Union

import torch

from ..kernels.pool_layout import TOKEN_MAJOR, check_layout
from .torch_attention import decode_attention, decode_gather, paged_prefill_attention, write_kv

__all__ = ["AttentionBackend", "TorchBackend", "BACKENDS", "resolve_backend"]


class AttentionBackend(Protocol):
    """What the paged cache calls for every layer of a forward pass."""

    name: str

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_table: torch.Tensor, seq_len: int, query_positions: torch.Tensor,
                scale: float) -> torch.Tensor: ...

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor: ...


class TorchBackend:
    """Paged attention in plain PyTorch over pools of `layout`: gather the blocks, then attend.

    Shapes (one layer):
        write_kv: key, value [num_tokens, num_key_value_heads, head_dim], cache dtype;
            slot_mapping [num_tokens] int64 (slot = block_id * block_size + offset).
        prefill: query [num_tokens, num_attention_heads, head_dim]; block_table
            [num_blocks_of_sequence] int64; seq_len int; query_positions [num_tokens] int64.
        decode: query [num_seqs, num_attention_heads, head_dim]; block_tables
            [num_seqs, max_blocks_per_seq] int64 (padded); seq_lens [num_seqs] int64.
        Both return attention outputs shaped like query, in query's dtype. `scale` multiplies the
        scores (1 / sqrt(head_dim) for Llama).
    """

    name = "torch"

    def __init__(self, layout: str = TOKEN_MAJOR):
        self.layout = check_layout(layout)
        self._gather, self._gather_for = None, None

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        write_kv(k_cache, v_cache, key, value, slot_mapping, layout=self.layout)

    def prefill(self, query, k_cache, v_cache, block_table, seq_len, query_positions, scale):
        return paged_prefill_attention(query, k_cache, v_cache, block_table, seq_len,
                                       query_positions=query_positions, scale=scale,
                                       layout=self.layout)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale):
        return decode_attention(query, k_cache, v_cache,
                                self._decode_gather(block_tables, seq_lens, k_cache), scale)

    def _decode_gather(self, block_tables, seq_lens, k_cache):
        """`decode_gather` once per forward pass, reused by every layer (vLLM builds its attention
        metadata once per step) while tables, lengths (compared, not trusted) and pool shape agree.
        """
        last = self._gather_for
        if not (last is not None and last[2] == k_cache.shape
                and torch.equal(last[0], block_tables) and torch.equal(last[1], seq_lens)):
            self._gather = decode_gather(block_tables, seq_lens, k_cache, self.layout)
            self._gather_for = (block_tables.clone(), seq_lens.clone(), k_cache.shape)
        return self._gather

    def __repr__(self) -> str:
        return f"TorchBackend(layout={self.layout!r})"


def _triton_backend(layout: str = TOKEN_MAJOR) -> AttentionBackend:
    """Stage 5's kernels (`kvlab.kernels.backend`); imports Triton only when chosen."""
    try:
        from ..kernels.backend import TritonBackend
    except ImportError as error:
        raise ValueError(f"the triton attention backend needs Triton ({error}); install it with "
                         "`pip install triton` (Linux), or use the torch backend") from None
    return TritonBackend(layout)


# Name -> factory(layout). A factory (not an instance) so a backend that needs an optional package
# (Triton) imports it only when chosen.
BACKENDS: dict[str, Callable[..., AttentionBackend]] = {"torch": TorchBackend,
                                                         "triton": _triton_backend}

BackendLike = Union[str, AttentionBackend, None]


def resolve_backend(backend: BackendLike = None, layout: str | None = None) -> AttentionBackend:
    """The backend for a name in `BACKENDS`, a backend object, or None (torch), in `layout`
    (None: the object's own, token-major for a name). ValueError: an unknown name or layout, an
    object missing write_kv, prefill or decode, or one whose `layout` differs from `layout`."""
    if backend is None or isinstance(backend, str):
        name = backend or "torch"
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from "
                             f"{', '.join(BACKENDS)}")
        return BACKENDS[name](check_layout(layout or TOKEN_MAJOR))
    missing = [m for m in ("write_kv", "prefill", "decode") if not callable(getattr(backend, m, None))]
    if missing:
        raise ValueError(f"{backend!r} is not an attention backend: it has no {', '.join(missing)}")
    own = getattr(backend, "layout", TOKEN_MAJOR)
    if layout is not None and check_layout(layout) != own:
        raise ValueError(f"{backend!r} reads {own} pools, but the pool is {layout}")
    return backend
