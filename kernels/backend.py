"""The stage-5 kernels as an attention backend of the paged cache (`kvlab.paged.backends`).

`PagedKVCache(..., attention_backend="triton")` (or `kvlab generate --cache paged --attention
triton`) routes every layer's K/V writes through `kvlab.kernels.write_kv` and every decode step
through `kvlab.kernels.paged_attention.paged_attention_decode`. Prefill (many query tokens of one
sequence) stays on the PyTorch path: stage 5's kernel is a decode kernel, and vLLM too runs prefill
and decode through different kernels.

Without a GPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1 before Triton is
first imported (the CLI and the tests do), or the first call raises a ValueError saying so.
"""

from __future__ import annotations

import torch

from ..paged.torch_attention import paged_prefill_attention
from .paged_attention import paged_attention_decode
from .pool_layout import TOKEN_MAJOR, check_layout
from .write_kv import write_kv

__all__ = ["TritonBackend"]


class TritonBackend:
    """Write K/V and attend in decode with Triton kernels; prefill in PyTorch.

    Args:
        layout: the pool layout it reads, "token-major" (default) or "head-major".

    Shapes and dtypes: as `kvlab.paged.backends.TorchBackend` (float16, bfloat16, float32 pools).
    """

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
