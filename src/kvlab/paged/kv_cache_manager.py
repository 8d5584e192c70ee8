"""The KV cache manager: block tables of all sequences on top of one block pool.

Everything a scheduler asks of the cache goes through here, and none of it touches a tensor:

* `allocate`: a new sequence reserves slots for its prompt (prefill),
* `append_slots`: a running sequence reserves the slot of its next token (decode); a block is
  taken from the pool only when the sequence crosses a block boundary,
* `fork`: a child sequence shares all of its parent's blocks (parallel sampling, n > 1),
* `free` / `preempt`: a sequence lets go of its blocks (finished, or evicted to recompute later).

Copy-on-write (vLLM paper, Kwon et al., SOSP 2023, section 4.4): after a fork, parent and child
hold the same blocks with ref count 2. Full blocks are never written again, so sharing them is safe
forever. The last block is the exception: when it is partly filled and shared, the next token of
either sequence would land in the other's block. So before that write the writer gets a fresh block,
the data of the shared block is copied into it, and the shared block's ref count drops by one. The
manager only decides the copy: it returns (src, dst) block pairs and `PagedKVCache` copies the K/V
bytes in every layer (vLLM v0 returned the same `blocks_to_copy` to its workers).

Every method checks its arguments and capacity first and mutates after, so a failed call changes
no state: a negative or non-integer count, an unknown sequence, a block the pool does not have are
refused with the value in the message.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable

from .block_pool import BlockPool
from .block_table import BlockTable, cdiv
from ..errors import NoFreeBlocksError, RequestTooLongError
from ..checks import check_int

__all__ = ["KVCacheManager", "SlotReservation"]


@dataclasses.dataclass
class SlotReservation:
    """What `append_slots` reserved.

    Attributes:
        slots: one slot (block_id * block_size + offset) per new token, in position order.
        copies: (src_block_id, dst_block_id) pairs to copy before writing (copy-on-write).
    """

    slots: list[int]
    copies: list[tuple[int, int]]


class KVCacheManager:
    """Block tables per sequence, allocated from one `BlockPool`.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (vLLM's default is 16; section 7.2 of the paper weighs it).

    Sequence ids are any hashable (ints, strings, tuples).

    Raises:
        ValueError: num_blocks or block_size not a positive integer.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = check_int("block_size", block_size, 1)
        self.pool = BlockPool(num_blocks)
        self.tables: dict[Hashable, BlockTable] = {}
        self.num_cow_copies = 0  # blocks copied by copy-on-write since start-up

    # ---- the four operations -----------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Start a sequence holding `num_tokens` tokens (a prompt); returns their slots.

        Takes cdiv(num_tokens, block_size) blocks.

        Raises:
            ValueError: seq_id is already allocated, or num_tokens is not an integer >= 1.
            RequestTooLongError: more tokens than the whole pool holds (can never fit).
            NoFreeBlocksError: not enough free blocks now (nothing changed).
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        num_tokens = check_int("num_tokens", num_tokens, 1)
        table = BlockTable(self.block_size)
        self._check_fits(seq_id, table, num_tokens)
        table.block_ids = self.pool.allocate(table.num_blocks_after(num_tokens))
        self.tables[seq_id] = table  # only now, after the allocation succeeded
        return self._reserve(table, num_tokens)

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> SlotReservation:
        """Reserve slots for `num_new_tokens` more tokens of a running sequence.

        Takes a new block only when the tokens cross a block boundary. If the last block is partly
        filled and shared (ref count > 1), it is first replaced by a private copy (copy-on-write);
        the returned `copies` say which block data to copy.

        Raises:
            KeyError: unknown seq_id.
            ValueError: num_new_tokens is not an integer >= 0.
            RequestTooLongError: the sequence would outgrow the whole pool.
            NoFreeBlocksError: not enough free blocks now (nothing changed; preempt and retry).
        """
        table = self._table(seq_id)
        num_new_tokens = check_int("num_new_tokens", num_new_tokens, 0)
        self._check_fits(seq_id, table, num_new_tokens)
        copies = []
        if num_new_tokens > 0 and self._must_copy_last_block(table):
            [new_block] = self.pool.allocate(1)
            old_block = table.block_ids[-1]
            table.block_ids[-1] = new_block
            self.pool.release([old_block])  # the siblings keep it; this sequence now has its own
            copies.append((old_block, new_block))
            self.num_cow_copies += 1
        table.block_ids += self.pool.allocate(table.num_blocks_after(num_new_tokens))
        return SlotReservation(self._reserve(table, num_new_tokens), copies)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start `child_id` as a copy of `parent_id` that shares every block (ref count + 1 each).

        Costs no blocks and copies no data: that is the saving of parallel sampling (section 4.4).

        Raises:
            KeyError: unknown parent_id.
            ValueError: child_id already has a block table.
        """
        parent = self._table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        for block_id in parent.block_ids:
            self.pool.share(block_id)
        self.tables[child_id] = BlockTable(self.block_size, list(parent.block_ids),
                                           parent.num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """A sequence lets go of its blocks; each returns to the free queue when no one else holds it.

        Blocks are released last block first, as vLLM v1 does: the tail of a sequence is the part
        least likely to be shared by a later request, so it should be reused first (stage 6).

        Raises:
            KeyError: unknown seq_id.
        """
        table = self._table(seq_id)
        self.pool.release(reversed(table.block_ids))
        del self.tables[seq_id]

    def preempt(self, seq_id: Hashable) -> int:
        """Evict a sequence by recompute (section 4.5): free its blocks now, rebuild them later.

        Returns:
            tokens whose K/V are dropped, which a later prefill must compute again.

        Raises:
            KeyError: unknown seq_id.
        """
        num_tokens = self._table(seq_id).num_tokens
        self.free(seq_id)
        return num_tokens

    # ---- capacity checks ---------------------------------------------------------------------

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int = 1) -> int:
        """Free blocks `append_slots(seq_id, num_new_tokens)` would take (copy-on-write included).

        Raises:
            KeyError: unknown seq_id. ValueError: num_new_tokens is not an integer >= 0.
        """
        table = self._table(seq_id)
        return self._blocks_needed(table, check_int("num_new_tokens", num_new_tokens, 0))

    def _table(self, seq_id: Hashable) -> BlockTable:
        """The block table of a sequence; KeyError naming the id when there is none."""
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}: it has no block table (never "
                           f"allocated, or already freed)") from None

    def _blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        copy = num_new_tokens > 0 and self._must_copy_last_block(table)
        return table.num_blocks_after(num_new_tokens) + int(copy)

    def _must_copy_last_block(self, table: BlockTable) -> bool:
        """The next token lands in a partly filled block that another sequence also holds."""
        return (table.num_tokens % self.block_size != 0
                and self.pool.ref_count(table.block_ids[-1]) > 1)

    def _check_fits(self, seq_id: Hashable, table: BlockTable, num_new_tokens: int) -> None:
        total = table.num_tokens + num_new_tokens
        if cdiv(total, self.block_size) > self.pool.num_blocks:
            raise RequestTooLongError(
                f"sequence {seq_id!r} would hold {total} tokens = {cdiv(total, self.block_size)} "
                f"blocks of {self.block_size}, more than the whole pool of "
                f"{self.pool.num_blocks} blocks ({self.pool.num_blocks * self.block_size} tokens)")
        needed = self._blocks_needed(table, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {needed} blocks for {num_new_tokens} more tokens, "
                f"{self.pool.num_free_blocks} of {self.pool.num_blocks} are free")

    def _reserve(self, table: BlockTable, num_new_tokens: int) -> list[int]:
        """Slots of the next `num_new_tokens` positions (their blocks already exist)."""
        first = table.num_tokens
        table.num_tokens += num_new_tokens
        return [table.slot(position) for position in range(first, table.num_tokens)]

    # ---- inspection --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Physical blocks held (a shared block counts once)."""
        return self.pool.num_used_blocks

    @property
    def num_logical_blocks(self) -> int:
        """Block table entries over all sequences: the blocks needed if nothing were shared."""
        return sum(len(table.block_ids) for table in self.tables.values())

    @property
    def num_stored_tokens(self) -> int:
        """Distinct token slots holding data: a block shared by a fork counts once.

        Shared blocks are never written before a copy, so every holder sees the same fill level.
        """
        filled: dict[int, int] = {}
        for table in self.tables.values():
            for index, block_id in enumerate(table.block_ids):
                filled[block_id] = max(filled.get(block_id, 0), table.tokens_in_block(index))
        return sum(filled.values())

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose slots the sequence holds. Raises KeyError for an unknown seq_id."""
        return self._table(seq_id).num_tokens

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table (block ids in logical order). KeyError if unknown."""
        return list(self._table(seq_id).block_ids)

    def format_block_tables(self) -> str:
        """A printable picture: each sequence's block table, ref counts > 1 marked, the free queue.

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
        for seq_id, table in self.tables.items():
            ids = " ".join(f"{b}{'*' if b in shared else ''}" for b in table.block_ids)
            last = table.tokens_in_block(len(table.block_ids) - 1) if table.block_ids else 0
            lines.append(f"  seq {seq_id!r:>5} {table.num_tokens:4d} tokens  [{ids}]   "
                         f"last block {last}/{self.block_size} full")
        if shared:
            lines.append("shared (block: ref count): "
                         + ", ".join(f"{b}: {r}" for b, r in sorted(shared.items())))
        lines.append("free queue (head first): "
                     + " ".join(str(block.block_id) for block in pool.free_queue))
        return "\n".join(lines)
