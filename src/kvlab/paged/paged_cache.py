"""The paged KV cache: the block pool tensors, the KV cache manager, and the KV stores a model runs on.

Per layer, one K tensor and one V tensor of shape [num_blocks, block_size, num_key_value_heads,
head_dim] are allocated once, at start-up, and never resized (vLLM paper, Kwon et al., SOSP 2023,
section 4.2). A block id names the same rows in every layer, so one block table serves all layers.

`PagedKVCache` holds the tensors and the one `KVCacheManager` that names their blocks (the
scheduler's; it is given one, or makes a plain one). For a forward pass it hands out a KV store
(see `kvlab.model.KVStore`), `PagedBatchStore`: the new tokens of several sequences laid out flat,
any mix of prefill chunks (many tokens of one sequence) and decode rows (one new token of a
sequence), as vLLM v1 runs a step. Its slot mapping is computed here, once per pass, from the
block tables.

In every layer the store first writes the K/V of every token of the pass into its slot, and only
then attends (`kvlab.paged.backends`): the decode rows together through the backend's batched
`decode`, each prefill chunk through its `prefill`. So a token may read a block that another
sequence of the same pass writes, whatever their order; the prefix cache relies on it
(`kvlab.prefix.manager`). vLLM v1 works the same way: one flattened batch per step, its new K/V
written to their slots (`reshape_and_cache`) before the attention kernel runs.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Hashable, Sequence

import torch

from ..config import LlamaConfig
from ..device import default_dtype, resolve_device
from ..dtypes import DTypeLike, torch_dtype
from ..sizing import format_bytes
from .budget import check_pool_fits, kv_block_bytes
from ..errors import KVCacheOutOfMemory
from ..checks import check_index, check_int, check_model_len
from .backends import BackendLike, resolve_backend
from .block_table import cdiv
from .kv_cache_manager import KVCacheManager
from ..kernels.pool_layout import TOKEN_MAJOR, pool_shape
from .torch_attention import gather_kv

__all__ = ["PagedKVCache", "PagedBatchStore"]


class PagedKVCache:
    """A block pool of `num_blocks` blocks of `block_size` tokens, in every layer.

    num_blocks: see `num_blocks_for_budget` to derive it from memory. dtype (as in `kvlab.dtypes`)
    and device: use the model's. max_model_len: if given, checked at start-up to fit in the pool.
    attention_backend: a name in `BACKENDS` ("torch", "triton"), a backend object, or None (torch).
    layout: "token-major" or "head-major" (`kvlab.kernels.pool_layout`), chosen once; None: the
    backend's own. manager: the `KVCacheManager` naming the blocks (e.g. from
    `kvlab.serving.engine_core.simulated_manager`; default: a plain one of these sizes).

    k_caches, v_caches hold one zero-filled tensor per layer, [num_blocks, block_size,
    num_key_value_heads, head_dim] (or head-major). block_bytes: bytes of one block id over all
    layers, K and V. allocator_delta_bytes: CUDA only, torch.cuda.memory_allocated growth while the
    pool was allocated (compare with pool_bytes), None on CPU. scale: 1 / sqrt(head_dim).

    ValueError: num_blocks or block_size not a positive integer, max_model_len < 1, an unknown
    backend or layout, or a backend object of another layout. KVCacheOutOfMemory: the pool cannot
    hold one max_model_len request, or (CUDA) the device has no room for it (message with numbers).
    """

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int = 16,
                 dtype: DTypeLike | None = None, device: str | torch.device | None = None,
                 max_model_len: int | None = None, attention_backend: BackendLike = None,
                 layout: str | None = None, manager: KVCacheManager | None = None):
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        if manager is None:
            manager = KVCacheManager(num_blocks, block_size)
        elif (manager.pool.num_blocks, manager.block_size) != (num_blocks, block_size):
            raise ValueError(f"a manager of {manager.pool.num_blocks} blocks of "
                             f"{manager.block_size} for a pool of {num_blocks} blocks of "
                             f"{block_size}")
        self.manager = manager
        self.backend = resolve_backend(attention_backend, layout)
        self.layout = getattr(self.backend, "layout", TOKEN_MAJOR)
        self.scale = config.head_dim ** -0.5
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.device = resolve_device(device)  # defaults: the course's (kvlab.device)
        self.dtype = dtype = torch_dtype(dtype if dtype is not None else default_dtype(self.device))
        self.block_bytes = kv_block_bytes(config, block_size, dtype)
        self.bytes_per_token = self.block_bytes // block_size
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, 1)
            check_pool_fits(num_blocks, block_size, max_model_len, self.block_bytes)
        self.max_model_len = max_model_len

        shape = pool_shape(self.layout, num_blocks, block_size, config.num_key_value_heads,
                           config.head_dim)
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else None
        try:
            self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                             for _ in range(config.num_hidden_layers)]
            self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                             for _ in range(config.num_hidden_layers)]
        except torch.cuda.OutOfMemoryError as error:
            self.k_caches = self.v_caches = []
            free, total = torch.cuda.mem_get_info(self.device)
            raise KVCacheOutOfMemory(
                f"block pool of {num_blocks} blocks x {format_bytes(self.block_bytes)} = "
                f"{format_bytes(num_blocks * self.block_bytes)} > {format_bytes(free)} free of "
                f"{format_bytes(total)} on {self.device}") from error
        # The allocator's own count of what the pool took, to cross-check `pool_bytes` (not
        # `reserved_bytes`: here the allocation is the whole pool, held or free).
        self.allocator_delta_bytes = (torch.cuda.memory_allocated(self.device) - before
                                           if cuda else None)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16,
                  max_model_len: int | None = None,
                  attention_backend: BackendLike = None, layout: str | None = None,
                  manager: KVCacheManager | None = None) -> "PagedKVCache":
        """A pool with the model's shape, dtype and device. ValueError: max_model_len above the
        model's max_position_embeddings (both numbers in the message), or as `PagedKVCache`."""
        if max_model_len is not None:
            max_model_len = check_model_len(model.config, max_model_len)
        return cls(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device,
                   max_model_len=max_model_len, attention_backend=attention_backend,
                   layout=layout, manager=manager)

    @torch.no_grad()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K/V into `dst` in every layer; ValueError outside [0, num_blocks)."""
        src = check_index("src block_id", src, self.num_blocks)
        dst = check_index("dst block_id", dst, self.num_blocks)
        for k_cache, v_cache in zip(self.k_caches, self.v_caches):
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pool tensors of one layer. Raises ValueError outside [0, num_hidden_layers)."""
        layer_index = check_index("layer_index", layer_index, len(self.k_caches))
        return self.k_caches[layer_index], self.v_caches[layer_index]

    # ---- KV stores for a forward pass --------------------------------------------------------

    def batch_store(self, seq_ids: Sequence[Hashable],
                    query_lens: Sequence[int]) -> "PagedBatchStore":
        """The KV store for one forward pass over the last query_lens[i] tokens whose slots
        seq_ids[i] holds (K/V not yet written), flat in order. ValueError: no seq_ids, a query_len
        < 1 or above the tokens held, or a different number of query_lens. KeyError: unknown seq_id.
        """
        block_tables, seq_lens = self.block_tables_tensor(seq_ids)
        slot_mapping = self._slot_mapping(block_tables, seq_lens, seq_ids, query_lens)
        return PagedBatchStore(self, slot_mapping, block_tables, seq_lens, query_lens)

    def slot_mapping(self, seq_ids: Sequence[Hashable], query_lens: Sequence[int]) -> torch.Tensor:
        """Slots of the newest query_lens[i] tokens of each seq_ids[i], flat [sum(query_lens)]
        int64: block_id * block_size + offset, read from the block tables (errors: batch_store)."""
        block_tables, seq_lens = self.block_tables_tensor(seq_ids)
        return self._slot_mapping(block_tables, seq_lens, seq_ids, query_lens)

    def _slot_mapping(self, block_tables, seq_lens, seq_ids, query_lens) -> torch.Tensor:
        """The slot mapping, computed once per pass, vectorised: position p of sequence i lives
        at block_tables[i, p // block_size] * block_size + p % block_size."""
        if len(query_lens) != len(seq_ids):
            raise ValueError(f"{len(query_lens)} query_lens for {len(seq_ids)} sequences")
        for seq_id, query_len, seq_len in zip(seq_ids, query_lens, seq_lens.tolist()):
            check_int(f"query_len of sequence {seq_id!r}", query_len, 1, seq_len)
        lens = self._tensor(list(query_lens))
        rows = torch.repeat_interleave(torch.arange(len(seq_ids), device=self.device), lens)
        # position of each new token: its sequence's start (seq_len - query_len) + its rank
        starts = torch.cumsum(lens, 0) - lens
        positions = (seq_lens - lens)[rows] + torch.arange(int(lens.sum()),
                                                           device=self.device) - starts[rows]
        size = self.block_size
        return block_tables[rows, positions // size] * size + positions % size

    # A short block table is padded with this id: a real block (another sequence's, or free and
    # holding whatever its last user left, NaN included), so every entry is a valid pool index.
    # Only seq_lens says which slots belong to a sequence; every backend keeps the rest out of the
    # output (the contract in `kvlab.paged.backends`, tests/test_poisoned_pool.py).
    PAD_BLOCK_ID = 0

    def block_tables_tensor(self, seq_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [num_seqs, max_blocks_per_seq] int64, padded with PAD_BLOCK_ID, and seq_lens
        [num_seqs] int64. ValueError: no seq_ids. KeyError: an unknown seq_id."""
        if len(seq_ids) == 0:
            raise ValueError("block_tables_tensor needs at least one seq_id")
        tables = [self.manager.block_ids(seq_id) for seq_id in seq_ids]
        width = max(len(table) for table in tables)
        padded = [table + [self.PAD_BLOCK_ID] * (width - len(table)) for table in tables]
        seq_lens = [self.manager.num_tokens(seq_id) for seq_id in seq_ids]
        return self._tensor(padded), self._tensor(seq_lens)

    def gather(self, seq_id: Hashable, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one sequence's keys and values of one layer, [num_tokens, H_kv, head_dim] each.
        KeyError: unknown seq_id. ValueError: layer_index outside [0, num_hidden_layers)."""
        k_cache, v_cache = self.layer(layer_index)
        block_table = self._tensor(self.manager.block_ids(seq_id))
        num_tokens = self.manager.num_tokens(seq_id)
        return (gather_kv(k_cache, block_table, num_tokens, self.layout),
                gather_kv(v_cache, block_table, num_tokens, self.layout))

    # ---- accounting: exact bytes, counted, never estimated -----------------------------------

    @property
    def pool_bytes(self) -> int:
        """Bytes of every K and V pool tensor: what the cache really allocated, held or free."""
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

    @property
    def allocated_bytes(self) -> int:
        """Bytes the cache allocated: the whole pool (`pool_bytes`), held or free."""
        return self.pool_bytes

    @property
    def num_tensors(self) -> int:
        """Tensors the pool allocated: one K and one V tensor per layer."""
        return len(self.k_caches) + len(self.v_caches)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the blocks held by sequences (a shared block once): blocks used x block_bytes."""
        return self.manager.num_used_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Distinct tokens stored x KV bytes per token: a slot counts from when it is reserved
        (`allocate_slots`), before the forward pass writes it; a block shared by a fork once."""
        return self.manager.num_stored_tokens * self.bytes_per_token

    @property
    def waste(self) -> float:
        """1 - used / reserved: empty slots in last blocks (under one block per sequence); 0 if idle."""
        reserved = self.reserved_bytes
        return 1.0 - self.used_bytes / reserved if reserved else 0.0

    def format_block_tables(self) -> str:
        """Block tables, shared blocks and the free queue, as text (see the manager's example)."""
        return self.manager.format_block_tables()

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.num_blocks} blocks x {self.block_size} tokens, "
                f"{self.manager.num_used_blocks} used, pool {format_bytes(self.pool_bytes)})")


class PagedBatchStore:
    """KV store for one forward pass over the new tokens of several sequences, laid out flat.

    Sequence i's query_lens[i] new tokens follow sequence i - 1's: one token is a decode row, more
    make a prefill chunk. slot_mapping [num_tokens] int64, one slot per token; block_tables
    [num_seqs, max_blocks_per_seq] int64 (padded with PAD_BLOCK_ID); seq_lens [num_seqs] int64,
    tokens of each sequence once this pass has written. Each layer writes, then attends (see the
    module docstring).
    """

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_lens: Sequence[int]):
        if slot_mapping.shape != (sum(query_lens),):
            raise ValueError(f"slot_mapping of shape {tuple(slot_mapping.shape)} for "
                             f"{sum(query_lens)} new tokens: give one slot per token")
        self.cache, self.slot_mapping = cache, slot_mapping
        # Which rows go to which kernel, worked out once for every layer of the pass.
        starts = [0, *accumulate(query_lens)]
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        self.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.long,
                                        device=slot_mapping.device)
        self.decode_block_tables, self.decode_seq_lens = block_tables[decode], seq_lens[decode]
        self.prefill_chunks = []  # (first token, end token, the sequence's blocks, its seq_len)
        for i, (start, query_len, seq_len) in enumerate(zip(starts, query_lens,
                                                            seq_lens.tolist())):
            if query_len > 1:
                blocks = block_tables[i, :cdiv(seq_len, cache.block_size)]
                self.prefill_chunks.append((start, start + query_len, blocks, seq_len))

    def attend(self, layer_index, query, key, value, positions):
        cache = self.cache
        k_cache, v_cache = cache.layer(layer_index)
        cache.backend.write_kv(k_cache, v_cache, key, value, self.slot_mapping)
        if not self.prefill_chunks:  # decode rows only, already in token order
            return self._decode(query, k_cache, v_cache)
        output = torch.empty_like(query)
        if self.decode_rows.numel():
            output[self.decode_rows] = self._decode(query[self.decode_rows], k_cache, v_cache)
        for start, end, block_table, seq_len in self.prefill_chunks:
            output[start:end] = cache.backend.prefill(query[start:end], k_cache, v_cache,
                                                      block_table, seq_len, positions[start:end],
                                                      cache.scale)
        return output

    def _decode(self, query, k_cache, v_cache):
        return self.cache.backend.decode(query, k_cache, v_cache, self.decode_block_tables,
                                         self.decode_seq_lens, self.cache.scale)
