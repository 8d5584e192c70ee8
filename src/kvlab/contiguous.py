"""The naive KV cache: one contiguous slab of max_model_len tokens reserved per request.

Early serving stacks (FasterTransformer, Orca as described in the vLLM paper) reserved at start-up
`max_num_seqs` slabs, each big enough for a request of `max_model_len` tokens, whatever it really
uses: a request that stops after 200 tokens leaves the rest of its 4,096-token slab empty, and no
other request may use it. The vLLM paper (Kwon et al., SOSP 2023, section 3 and figure 2) measured
only 20.4-38.2 % of such reservations holding token states. Per layer, `k[layer]` and `v[layer]` are
[max_num_seqs, max_model_len, num_key_value_heads, head_dim], the token at position p of slab `s` at
`[s, p]`. The KV stores (`kvlab.model.KVStore`): `ContiguousSequence` for a notebook's own loop,
`SlabBatchStore` for a serving step, over any per-sequence memory of this shape (the naive
strategy's tensors, `kvlab.tools.oom_story.naive`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from .attention import grouped_attention
from .config import LlamaConfig
from .device import default_dtype, resolve_device
from .dtypes import DTypeLike, torch_dtype
from .errors import KVCacheOutOfMemory
from .checks import check_index, check_int
from .sizing import format_bytes, kv_bytes_per_token

__all__ = ["ContiguousKVCache", "ContiguousSequence", "SlabBatchStore", "reservation_bytes"]


def reservation_bytes(config: LlamaConfig, max_num_seqs: int, max_model_len: int,
                      element_bytes: DTypeLike) -> int:
    """Bytes a naive server reserves up front: max_num_seqs x max_model_len x KV bytes per token.
    `element_bytes` is the cache dtype: a size (2), a name ("bf16") or a torch dtype."""
    return max_num_seqs * max_model_len * kv_bytes_per_token(config, element_bytes)


class ContiguousKVCache:
    """`max_num_seqs` slabs of `max_model_len` tokens (`config` gives only the KV shape), or
    KVCacheOutOfMemory with the arithmetic ("128 seqs x 4096 tokens x 128 KiB = 64 GiB > 40 GiB
    budget") past `budget_bytes` (on CPU, a stand-in for free GPU memory) or CUDA's free memory."""

    def __init__(self, config: LlamaConfig, max_num_seqs: int, max_model_len: int,
                 dtype: DTypeLike | None = None, device: str | torch.device | None = None,
                 budget_bytes: int | None = None):
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        max_model_len = check_int("max_model_len", max_model_len, 1)
        self.config, self.max_num_seqs, self.max_model_len = config, max_num_seqs, max_model_len
        self.device = resolve_device(device)  # defaults: the course's (kvlab.device)
        self.dtype = torch_dtype(dtype if dtype is not None else default_dtype(self.device))
        self.bytes_per_token = kv_bytes_per_token(config, self.dtype)
        wanted = reservation_bytes(config, max_num_seqs, max_model_len, self.dtype)
        formula = (f"{max_num_seqs} seqs x {max_model_len} tokens x "
                   f"{format_bytes(self.bytes_per_token)}/token = {format_bytes(wanted)}")
        if budget_bytes is not None and wanted > budget_bytes:
            raise KVCacheOutOfMemory(f"KV cache reservation {formula} > "
                                     f"{format_bytes(budget_bytes)} budget")

        shape = (config.num_hidden_layers, max_num_seqs, max_model_len,
                 config.num_key_value_heads, config.head_dim)
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        try:
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except torch.cuda.OutOfMemoryError as error:
            self.k = self.v = None
            free, total = torch.cuda.mem_get_info(self.device)
            raise KVCacheOutOfMemory(f"KV cache reservation {formula} > {format_bytes(free)} free "
                                     f"of {format_bytes(total)} on {self.device}") from error
        # The allocator's own count of what the slabs took, to cross-check `reserved_bytes`.
        self.allocator_delta_bytes = (torch.cuda.memory_allocated(self.device) - before
                                      if before is not None else None)
        self.seq_lens = [0] * max_num_seqs       # tokens held by each slab
        self.in_use = [False] * max_num_seqs

    @property
    def reserved_bytes(self) -> int:
        """Exact bytes of the K and V slabs (all of them, in use or not)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def allocated_bytes(self) -> int:
        """Bytes the cache allocated: here the same as `reserved_bytes` (every slab, up front)."""
        return self.reserved_bytes

    @property
    def num_tensors(self) -> int:
        """Tensors the cache allocated (the K slab and the V slab)."""
        return 2

    @property
    def used_bytes(self) -> int:
        """Bytes holding token states: tokens held by all slabs x KV bytes per token."""
        return sum(self.seq_lens) * self.bytes_per_token

    def add_sequence(self) -> int:
        """Claim a free slab, not cleared (attention reads only positions this sequence writes);
        KVCacheOutOfMemory (nothing changes) when all max_num_seqs are in use."""
        for slab, busy in enumerate(self.in_use):
            if not busy:
                self.in_use[slab], self.seq_lens[slab] = True, 0
                return slab
        raise KVCacheOutOfMemory(f"all {self.max_num_seqs} slabs (max_num_seqs) are in use")

    def fork_sequence(self, slab: int) -> int:
        """A new slab holding a copy of `slab`'s tokens (parallel sampling's siblings). Slabs cannot
        share memory, so every sibling copies the whole prompt, in every layer: the cost that block
        sharing with copy-on-write removes (Kwon et al., SOSP 2023, section 4.4)."""
        slab = self._slab_in_use(slab)
        child, held = self.add_sequence(), self.seq_lens[slab]
        self.k[:, child, :held] = self.k[:, slab, :held]
        self.v[:, child, :held] = self.v[:, slab, :held]
        self.seq_lens[child] = held
        return child

    def free_sequence(self, slab: int) -> None:
        """Give a slab back (ValueError on a double free); its bytes stay reserved, by design."""
        slab = self._slab_in_use(slab)
        self.in_use[slab], self.seq_lens[slab] = False, 0

    def view(self, slab: int) -> "ContiguousSequence":
        """The KV store (see `kvlab.model.KVStore`) of one sequence in use, for a forward pass."""
        return ContiguousSequence(self, self._slab_in_use(slab))

    def batch_store(self, slabs: Sequence[int], query_lens: Sequence[int],
                    seq_lens: Sequence[int]) -> "SlabBatchStore":
        """The `SlabBatchStore` of a pass over slabs' newest tokens, setting seq_lens. ValueError: a
        slab not in use, query_len outside [1, seq_len]; KVCacheOutOfMemory: over max_model_len."""
        slabs = [self._slab_in_use(slab) for slab in slabs]
        for slab, query_len, seq_len in zip(slabs, query_lens, seq_lens):
            if seq_len > self.max_model_len:
                raise KVCacheOutOfMemory(f"slab {slab} would hold {seq_len} tokens, past "
                                         f"max_model_len={self.max_model_len}")
            check_int(f"query_len of slab {slab}", query_len, 1, seq_len)
        for slab, seq_len in zip(slabs, seq_lens):
            self.seq_lens[slab] = seq_len
        return SlabBatchStore([self.k[:, slab] for slab in slabs],
                              [self.v[:, slab] for slab in slabs], query_lens, seq_lens)

    def _slab_in_use(self, slab: int) -> int:
        slab = check_index("slab", slab, self.max_num_seqs)
        if not self.in_use[slab]:
            raise ValueError(f"slab {slab} is not in use; call add_sequence() first")
        return slab


class ContiguousSequence:
    """One request's slab as a KV store: its tokens sit at positions 0 .. seq_len - 1, all written
    by it (prefill 0 .. P - 1, then one per decode step), so attention reads only slots it owns."""

    def __init__(self, cache: ContiguousKVCache, slab: int):
        self.cache, self.slab = cache, slab

    def attend(self, layer_index, query, key, value, positions):
        """Write K/V at `positions`, attend over 0 .. max(positions). ValueError: a position < 0 or
        an unwritten gap; KVCacheOutOfMemory: a position past max_model_len (nothing written)."""
        cache = self.cache
        check_index("layer_index", layer_index, cache.config.num_hidden_layers)
        first, end = int(positions.min()), int(positions.max()) + 1
        if end > cache.max_model_len:
            raise KVCacheOutOfMemory(f"position {end - 1} is past max_model_len="
                                     f"{cache.max_model_len} of slab {self.slab}")
        held = cache.seq_lens[self.slab]
        # Negative positions would wrap to the end of the slab; a gap would let attention read
        # slots this sequence never wrote (another request's leftovers).
        if first < 0 or first > held or positions.unique().numel() != end - first:
            raise ValueError(f"positions {first}..{end - 1} ({positions.numel()} tokens) do not "
                             f"continue slab {self.slab}'s {held} tokens without a gap; new "
                             f"tokens must be consecutive positions starting in [0, {held}]")
        if layer_index == cache.config.num_hidden_layers - 1:
            cache.seq_lens[self.slab] = max(held, end)
        store = SlabBatchStore([cache.k[:, self.slab]], [cache.v[:, self.slab]],
                               [positions.numel()], [end])
        return store.attend(layer_index, query, key, value, positions)


class SlabBatchStore:
    """KV store for one pass over sequences in their own memory, keys[i] and values[i]
    [num_hidden_layers, max_tokens, num_key_value_heads, head_dim], sequence i's query_lens[i] new
    tokens after i - 1's. Each layer writes all tokens' K/V, then attends each sequence's new ones
    over its first seq_lens[i] positions, causally, one after another (a padded kernel's loop)."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 query_lens: Sequence[int], seq_lens: Sequence[int]):
        self.keys, self.values, self.seq_lens = keys, values, seq_lens
        ends = list(accumulate(query_lens))
        self.rows = [(end - n, end) for end, n in zip(ends, query_lens)]  # tokens of each

    def attend(self, layer_index, query, key, value, positions):
        sequences = list(zip(self.rows, self.keys, self.values, self.seq_lens))
        for (first, end), keys, values, _ in sequences:
            keys[layer_index, positions[first:end]] = key[first:end]
            values[layer_index, positions[first:end]] = value[first:end]
        outputs = [grouped_attention(query[first:end], keys[layer_index, :seq_len],
                                     values[layer_index, :seq_len],
                                     query_positions=positions[first:end])
                   for (first, end), keys, values, seq_len in sequences]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
