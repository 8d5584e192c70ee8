"""What a learner prints and counts of a KV cache manager's block tables; no step runs these.

`KVCacheManager` (and stage 6's subclass) inherit them, so the verbs of a step stay alone in
`kv_cache_manager.py`. Every view reads the manager's `tables` (request_id -> `BlockTable`, looked
up by `_table`, KeyError for an unknown request), `pool` and `block_size`, and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .block_table import BlockTable

__all__ = ["ManagerViews"]


class ManagerViews:
    """Read-only views of the manager's `tables`, `pool` and `block_size`."""

    tables: dict[Hashable, BlockTable]
    pool: BlockPool
    block_size: int
    _table: Callable[[Hashable], BlockTable]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Physical blocks held (a shared block counts once)."""
        return self.pool.num_used_blocks

    def usage(self) -> float:
        """Share of the pool held now, 0 .. 1 (vLLM's `kv_cache_usage`)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def num_logical_blocks(self) -> int:
        """Block table entries over all requests: the blocks needed if nothing were shared."""
        return sum(len(table.block_ids) for table in self.tables.values())

    @property
    def num_stored_tokens(self) -> int:
        """Distinct token slots holding data: a block shared by a fork counts once (shared blocks
        are never written before a copy, so every holder sees the same fill level)."""
        filled: dict[int, int] = {}
        for table in self.tables.values():
            for index, block_id in enumerate(table.block_ids):
                filled[block_id] = max(filled.get(block_id, 0), table.tokens_in_block(index))
        return sum(filled.values())

    def num_tokens(self, request_id: Hashable) -> int:
        """Tokens whose slots the request holds."""
        return self._table(request_id).num_tokens

    def block_ids(self, request_id: Hashable) -> list[int]:
        """A copy of the request's block ids, in logical order."""
        return list(self._table(request_id).block_ids)

    def format_block_tables(self) -> str:
        """A printable picture: each request's block table, ref counts > 1 marked, the free queue.

        Example:
            block_size=4, 8 blocks: 3 used, 5 free, 1 shared
              seq 'a'   6 tokens  [0 1*]   last block 2/4 full
              seq 'b'   6 tokens  [0 1*]   last block 2/4 full
            shared (block: ref count): 1: 2
            free queue (head first): 2 3 4 5 6 7
        """
        pool = self.pool
        shared = {b.block_id: b.ref_count for b in pool.blocks if b.ref_count > 1}
        lines = [f"block_size={self.block_size}, {pool.num_blocks} blocks: "
                 f"{pool.num_used_blocks} used, {pool.num_free_blocks} free, {len(shared)} shared"]
        for request_id, table in self.tables.items():
            ids = " ".join(f"{b}{'*' if b in shared else ''}" for b in table.block_ids)
            last = table.tokens_in_block(len(table.block_ids) - 1) if table.block_ids else 0
            lines.append(f"  seq {request_id!r:>5} {table.num_tokens:4d} tokens  [{ids}]   "
                         f"last block {last}/{self.block_size} full")
        if shared:
            lines.append("shared (block: ref count): "
                         + ", ".join(f"{b}: {r}" for b, r in sorted(shared.items())))
        lines.append("free queue (head first): "
                     + " ".join(str(block.block_id) for block in pool.free_queue))
        return "\n".join(lines)
