"""The block pool's bookkeeping: which blocks are free, and how many block tables hold each one.

The pool is cut into `num_blocks` blocks at start-up and never grows or shrinks (vLLM paper, Kwon
et al., SOSP 2023, section 4.2: "the KV block manager ... physical KV blocks on GPU"). A block is
either in the free block queue (ref count 0) or held by one or more sequences (ref count >= 1; more
than one after a fork shares it, section 4.4).

This class holds no tensors. The K/V data lives in `PagedKVCache`, indexed by the same block_id.
vLLM splits it the same way: the scheduler's KV cache manager only decides which block ids a
sequence gets, the workers' tensors hold the bytes.
"""

from __future__ import annotations

from typing import Iterable

from .errors import NoFreeBlocksError
from .free_queue import Block, FreeBlockQueue

__all__ = ["BlockPool"]


class BlockPool:
    """`num_blocks` blocks, a free block queue, and a ref count per block.

    Args:
        num_blocks: blocks in the pool (block ids 0 .. num_blocks - 1, all free at start).

    Raises:
        ValueError: num_blocks < 1.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence (a shared block counts once)."""
        return self.num_blocks - len(self.free_queue)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free block queue; each gets ref count 1.

        Returns:
            the block ids, in the order taken.

        Raises:
            NoFreeBlocksError: fewer than `count` free blocks. Checked before anything is taken,
                so a failed allocation leaves the pool exactly as it was.
        """
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, only {self.num_free_blocks} of "
                                    f"{self.num_blocks} are free")
        taken = []
        for _ in range(count):
            block = self.free_queue.popleft()
            block.ref_count = 1
            taken.append(block.block_id)
        return taken

    def share(self, block_id: int) -> None:
        """One more block table holds this block (a fork): ref count + 1, no data is copied.

        Raises:
            ValueError: the block is free (only a held block can be shared).
        """
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free; only a held block can be shared")
        block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """One block table lets go of each block: ref count - 1; at 0 the block joins the free queue.

        A shared block stays held (and keeps its data) until its last holder releases it.

        Raises:
            ValueError: a block that is already free (a double free).
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} is already free (double free)")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
