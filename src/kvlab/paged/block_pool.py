"""The block pool's bookkeeping: which blocks are free, and how many block tables hold each one.

The pool is cut into `num_blocks` blocks at start-up and never grows or shrinks (vLLM paper, Kwon
et al., SOSP 2023, section 4.2: "the KV block manager ... physical KV blocks on GPU"). A block is
either in the free block queue (ref count 0) or held by one or more sequences (ref count >= 1; more
than one after a fork shares it, section 4.4).

The free block queue hands out the block at its head and takes a freed block at its tail, so the
block freed longest ago is reused first (least recently used). Those two ends are all stage 4
needs, and a `collections.deque` gives both in O(1). Stage 6's prefix cache also takes a freed
block back out of the *middle* (a hit on its cached K/V), O(n) in a deque: its `CachingBlockPool`
swaps in `FreeBlockQueue`, vLLM v1's doubly linked list, O(1) there too (`free_queue`).

No tensors here: the K/V lives in `PagedKVCache`, indexed by the same block_id. vLLM splits it the
same way: the scheduler's KV cache manager picks block ids, the workers' tensors hold the bytes.
"""

from __future__ import annotations

import collections
from typing import Iterable

from ..errors import NoFreeBlocksError
from ..checks import check_index, check_int

__all__ = ["Block", "BlockPool"]


class Block:
    """One block (page) of the pool: `block_size` token slots in every layer."""

    __slots__ = ("block_id", "ref_count", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id  # index into the pool tensors, 0 .. num_blocks - 1
        self.ref_count = 0        # block tables holding it: 0 = free, > 1 = shared after a fork
        # links used only by stage 6's linked `FreeBlockQueue` (None in a deque, or while held)
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:  # never follow the links: printing would walk the whole queue
        return f"Block(block_id={self.block_id}, ref_count={self.ref_count})"


class BlockPool:
    """`num_blocks` blocks (ids 0 .. num_blocks - 1, all free at start; ValueError unless a
    positive integer), a free block queue, and a ref count per block. A block id out of range is
    refused: a negative one would index the list from its end and touch the wrong block."""

    free_queue_type = collections.deque  # stage 6: `FreeBlockQueue`

    def __init__(self, num_blocks: int):
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = self.free_queue_type(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence (a shared block counts once)."""
        return self.num_blocks - len(self.free_queue)

    def ref_count(self, block_id: int) -> int:
        """Block tables holding the block (0 = free). Raises ValueError for an id out of range."""
        return self.blocks[check_index("block_id", block_id, self.num_blocks)].ref_count

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free block queue, ref count 1 each; their ids.
        ValueError: count is not an integer >= 0. NoFreeBlocksError: fewer than `count` are free
        (checked before anything is taken, so a failed allocation changes nothing)."""
        if type(count) is not int or count < 0:
            count = check_int("count", count, 0)
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, only {self.num_free_blocks} of "
                                    f"{self.num_blocks} are free")
        taken = self._take_free(count)
        self._before_reuse(taken)
        for block in taken:
            block.ref_count = 1
        return [block.block_id for block in taken]

    def _take_free(self, count: int) -> list[Block]:
        """The `count` blocks at the head of the free block queue, taken out of it."""
        popleft = self.free_queue.popleft
        return [popleft() for _ in range(count)]

    def _before_reuse(self, blocks: list[Block]) -> None:
        """Called with the free blocks `allocate` hands out, before anyone can write to them. The
        plain pool has nothing to forget; stage 6's `CachingBlockPool` drops their hashes."""

    def share(self, block_id: int) -> None:
        """One more block table holds this block (a fork): ref count + 1, no data is copied.
        ValueError: block_id out of range, or the block is free (only a held block is shared)."""
        block = self.blocks[check_index("block_id", block_id, self.num_blocks)]
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free; only a held block can be shared")
        block.ref_count += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """A request takes these blocks as computed ones (stage 6's cache hits): ref count + 1; a
        free one leaves the free block queue, from wherever it sits."""
        for block_id in self._checked(block_ids):  # all checked before any ref count moves
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def num_free_to_touch(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are free now, i.e. leave the free queue when touched."""
        return sum(1 for block_id in self._checked(block_ids)
                   if self.blocks[block_id].ref_count == 0)

    def _checked(self, block_ids: Iterable[int]) -> list[int]:
        """The ids as a list; ValueError for one out of range (negative ids index from the end)."""
        block_ids = list(block_ids)
        if block_ids and (set(map(type, block_ids)) != {int} or min(block_ids) < 0
                          or max(block_ids) >= self.num_blocks):  # C-speed test of the usual call
            block_ids = [check_index("block_id", block_id, self.num_blocks)
                         for block_id in block_ids]
        return block_ids

    def release(self, block_ids: Iterable[int]) -> None:
        """One block table lets go of each block: ref count - 1; at 0 it joins the free queue (a
        shared block keeps its data until its last holder releases it). ValueError: an id out of
        range, or a double free; every id is checked before any is released."""
        block_ids = self._checked(block_ids)
        held = [self.blocks[block_id] for block_id in block_ids]
        if len(set(block_ids)) < len(block_ids):  # one block released several times at once
            for block_id, times in collections.Counter(block_ids).items():
                self._check_held(block_id, times)
        else:
            for block in held:
                if block.ref_count == 0:
                    self._check_held(block.block_id, 1)
        append = self.free_queue.append
        for block in held:
            block.ref_count -= 1
            if block.ref_count == 0:
                append(block)

    def _check_held(self, block_id: int, times: int) -> None:
        """ValueError unless the block is held at least `times` times (a double free)."""
        if times > self.blocks[block_id].ref_count:
            raise ValueError(f"block {block_id} is released {times} time(s) but held by "
                             f"{self.blocks[block_id].ref_count} block table(s) (double free)")
