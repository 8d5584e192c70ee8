"""The stage-5 kernels as an attention backend of the paged cache (`kvlab.paged.backends`).

`PagedKVCache(..., attention_backend="triton")` (`kvlab generate --cache paged --attention triton`)
sends K/V writes to `kvlab.kernels.write_kv` and decode to `paged_attention_decode`. Prefill stays
in PyTorch: stage 5's kernel is a decode kernel (vLLM too runs the two through different kernels).
"""

from __future__ import annotations

import torch

from ..paged.torch_attention import paged_prefill_attention
from .paged_attention import paged_attention_decode
from .pool_layout import TOKEN_MAJOR, check_layout
from .write_kv import write_kv

__all__ = ["TritonBackend"]


class TritonBackend:
    """Triton writes and decode, PyTorch prefill; shapes and dtypes as `TorchBackend`'s."""

    name = "triton"

    def __init__(self, layout: str = TOKEN_MAJOR):
        self.layout = check_layout(layout)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, key, value, slot_mapping, layout=self.layout)

    def prefill(self, query, k_cache, v_cache, block_table, seq_len, query_positions, scale):
        return paged_prefill_attention(query, k_cache, v_cache, block_table, seq_len,
                                       query_positions=query_positions, scale=scale,
                                       layout=self.layout)

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention_decode(query, k_cache, v_cache, block_tables, seq_lens,
                                      scale=scale, layout=self.layout)

    def __repr__(self) -> str:
        return f"TritonBackend(layout={self.layout!r})"
