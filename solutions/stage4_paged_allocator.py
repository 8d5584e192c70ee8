"""Stage 4 exercise: a paged KV cache allocator, the memory manager of vLLM's PagedAttention.

vLLM (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023) cuts the KV cache into fixed-size blocks of `block_size` token slots
and gives each sequence a block table, its list of physical blocks in logical order, instead of one
max_model_len slab (stage 2). A sequence takes a new block only when its tokens cross a block
boundary, so it wastes less than one block; blocks come back the moment it finishes; and sampling
several continuations of one prompt shares the prompt's blocks, copying a block only when a
sequence is about to write into a shared one.

You write, with no tensors (the scheduler's side: it only decides which block ids a sequence gets):

* `slot_mapping`: where each token's K/V go, slot = block_id * block_size + offset.
* `TinyBlockAllocator`: allocate, append, fork, free, with ref counts and copy-on-write.

`kvlab check 4` compares yours with the course's allocator, `kvlab.paged.KVCacheManager`, on the
same operations. Read `src/kvlab/paged/` afterwards and compare (`block_table.py`,
`block_pool.py`, `kv_cache_manager.py`; the pool keeps its free blocks in a deque too, and stage
6's `free_queue.py` shows why vLLM v1 keeps them in a doubly linked list instead).

Units: `block_size` and token counts are numbers of tokens; block ids are ints 0 .. num_blocks-1;
a slot is a row of the flattened pool [num_blocks * block_size, num_key_value_heads, head_dim].
"""

from __future__ import annotations

import collections
from typing import Hashable, Sequence


def slot_mapping(block_table: Sequence[int], positions: Sequence[int],
                 block_size: int) -> list[int]:
    """The slot of each token: where its key and value are written in the flattened pool.

    Token at position p lives in logical block p // block_size, at offset p % block_size; the
    block table says which physical block that logical block is (paper section 4.2, figure 6):

        slot = block_table[p // block_size] * block_size + p % block_size

    Example: block_size 4, block_table [7, 2]: positions 0, 3, 4, 5 -> slots 28, 31, 8, 9.

    Args:
        block_table: physical block ids of one sequence, in logical order.
        positions: token positions (ints, any order).
        block_size: tokens per block.

    Returns:
        One slot (int) per position, in the order of `positions`.

    Raises:
        IndexError: a position < 0 or past the last block of the table (no block holds it yet).
            The message names the position and the table's capacity in tokens.
    """
    # BEGIN SOLUTION hint: position p is in the table's block p // block_size at offset p %
    # hint: block_size; the block table names that block's physical id, and a slot counts tokens
    # hint: from the pool's start; a position the table does not cover has no slot (IndexError)
    capacity = len(block_table) * block_size
    slots = []
    for position in positions:
        if not 0 <= position < capacity:
            raise IndexError(f"position {position} has no block: the table's {len(block_table)} "
                             f"blocks of {block_size} hold positions 0 .. {capacity - 1}")
        slots.append(block_table[position // block_size] * block_size + position % block_size)
    return slots
    # END SOLUTION


class NoFreeBlocksError(MemoryError):
    """Fewer free blocks than an operation needs right now; no state was changed.

    A scheduler reacts by preempting a sequence or waiting (paper section 4.5), then retries.
    """


class TinyBlockAllocator:
    """Block tables of many sequences over one pool of `num_blocks` blocks of `block_size` tokens.

    The state, set up here, that your methods keep consistent:

    Attributes:
        num_blocks: blocks in the pool (block ids 0 .. num_blocks - 1).
        block_size: token slots per block.
        free_blocks: the free list, ids of the blocks no sequence holds. Take blocks from its left
            end (`popleft`: block 0 first on a fresh pool) and give freed blocks back at its right
            end (`append`), so the block freed longest ago is reused first (vLLM v1's LRU free
            block queue).
        ref_counts: ref_counts[b] = how many block tables hold block b: 0 exactly when b is in
            free_blocks, > 1 when sequences share it after a fork (paper section 4.4).
        block_tables: seq_id -> its block ids, in logical order (entry i holds positions
            i * block_size .. (i + 1) * block_size - 1).
        num_tokens: seq_id -> tokens the sequence holds (positions 0 .. num_tokens - 1); only its
            last block can be partly filled.

    Every method checks first and changes state after: a call that raises leaves all four
    attributes exactly as they were (the scheduler retries it later).

    Args:
        num_blocks: blocks in the pool, >= 1.
        block_size: tokens per block, >= 1 (vLLM's default is 16).

    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got num_blocks="
                             f"{num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: collections.deque[int] = collections.deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        self.num_tokens: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self.free_blocks)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Start a sequence holding `num_tokens` tokens (its prompt, written by prefill).

        Takes ceil(num_tokens / block_size) blocks from the left of the free list, each with ref
        count 1 (paper section 4.3: the prompt's blocks are allocated at once, the rest on demand).

        Args:
            seq_id: a new sequence id (any hashable).
            num_tokens: prompt tokens, >= 1.

        Returns:
            The sequence's block table (a new list of block ids).

        Raises:
            ValueError: seq_id already has a block table, or num_tokens < 1.
            NoFreeBlocksError: fewer free blocks than needed; the message names how many blocks
                the sequence needs and how many are free, e.g.
                "sequence 'b' needs 3 blocks for 10 tokens, 2 of 8 are free".
        """
        # BEGIN SOLUTION hint: just enough blocks for the tokens (round up); all or nothing: refuse
        # hint: (NoFreeBlocksError) before taking any block, so a failed call changes no state; a
        # hint: new block has one owner
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        if num_tokens < 1:
            raise ValueError(f"a sequence starts with at least one token, got {num_tokens}")
        needed = -(-num_tokens // self.block_size)
        if needed > len(self.free_blocks):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {needed} blocks for {num_tokens} "
                                    f"tokens, {len(self.free_blocks)} of {self.num_blocks} are "
                                    f"free")
        table = [self.free_blocks.popleft() for _ in range(needed)]
        for block_id in table:
            self.ref_counts[block_id] = 1
        self.block_tables[seq_id] = table
        self.num_tokens[seq_id] = num_tokens
        return list(table)
        # END SOLUTION

    def append(self, seq_id: Hashable) -> tuple[int, int] | None:
        """Reserve the slot of one more token of a running sequence (one decode step).

        Three cases, by where the new token lands (position num_tokens[seq_id]):

        * the last block is full (num_tokens is a multiple of block_size): take a new block from
          the free list and add it to the table (paper section 4.3, figure 7);
        * the last block has room and only this sequence holds it: nothing to do;
        * the last block has room but is shared (ref count > 1, after a fork): writing into it
          would change the other sequences' tokens. Copy-on-write (section 4.4, figure 8): take a
          new block, put it in place of the shared one in this table, and drop the shared
          block's ref count by 1 (the others keep it). The block's K/V must be copied from the
          shared block into the new one before the write: return that (src, dst) pair.

        Then the sequence holds one more token.

        Args:
            seq_id: a sequence that has a block table.

        Returns:
            (src_block_id, dst_block_id) when a copy-on-write happened, else None.

        Raises:
            KeyError: unknown seq_id.
            NoFreeBlocksError: a new block is needed and none is free (nothing changed); the
                message names the sequence and the pool size.
        """
        # BEGIN SOLUTION hint: a new token needs a new block only when the last one is full; a last
        # hint: block another sequence shares (ref count > 1) must not be written: copy-on-write
        # hint: puts a fresh block in its place and reports (source, destination); make sure a free
        # hint: block exists before changing anything
        table = self.block_tables[seq_id]
        count = self.num_tokens[seq_id]
        last_full = count % self.block_size == 0
        shared = not last_full and self.ref_counts[table[-1]] > 1
        if (last_full or shared) and not self.free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs 1 block for token {count + 1}, "
                                    f"0 of {self.num_blocks} are free")
        copy = None
        if last_full:
            new_block = self.free_blocks.popleft()
            self.ref_counts[new_block] = 1
            table.append(new_block)
        elif shared:
            new_block = self.free_blocks.popleft()
            self.ref_counts[new_block] = 1
            old_block = table[-1]
            table[-1] = new_block
            self.ref_counts[old_block] -= 1  # > 1 before, so the others still hold it
            copy = (old_block, new_block)
        self.num_tokens[seq_id] = count + 1
        return copy
        # END SOLUTION

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start `child_id` as a copy of `parent_id` that shares all its blocks.

        The child gets its own block table listing the parent's blocks, and the same token count;
        each block's ref count goes up by 1. No block is taken and no data is copied: that is the
        saving of parallel sampling and beam search (paper section 4.4).

        Raises:
            KeyError: unknown parent_id.
            ValueError: child_id already has a block table.
        """
        # BEGIN SOLUTION hint: the child shares every block of the parent: the same blocks in a
        # hint: table of its own (a later append to one must not change the other), one more owner
        # hint: per block, the same token count
        table = self.block_tables[parent_id]
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = list(table)
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        # END SOLUTION

    def free(self, seq_id: Hashable) -> None:
        """A sequence finished (or is preempted): it lets go of its blocks.

        Remove its block table and token count; drop each of its blocks' ref count by 1, and a
        block whose count reaches 0 goes back to the right end of the free list. Go through the
        table last block first (as vLLM v1 does: a sequence's tail is the part least likely to be
        shared later, so it should be reused first). A block another sequence still holds stays.

        Raises:
            KeyError: unknown seq_id.
        """
        # BEGIN SOLUTION hint: each block loses this sequence as an owner; a block nobody owns goes
        # hint: back to the free list, the table's last block first (the docstring says why)
        table = self.block_tables.pop(seq_id)
        del self.num_tokens[seq_id]
        for block_id in reversed(table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_blocks.append(block_id)
        # END SOLUTION
