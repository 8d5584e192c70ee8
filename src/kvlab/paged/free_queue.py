"""Stage 6's free block queue: every block no sequence holds, in a doubly linked list.

Allocation takes the block at the head; a freed block goes to the tail. So the block that was freed
longest ago is reused first (least recently used). Stage 4's pool needs only those two ends (a
`collections.deque`, `block_pool`). With prefix caching a freed block still holds the K/V of its
tokens, and a new request with that same prefix takes it back out of the *middle*, from wherever it
sits: taking from the head (`popleft`, `popleft_many` for an allocation of several), `append`
(free) and `remove` must all cost O(1), whatever the pool size (vLLM v1 keeps ~10^5 blocks).

A Python `list` pops from the front in O(n); `collections.deque` removes from the middle in O(n).
Storing the two links on the block itself makes all three O(1): that is the design of vLLM v1's
free block queue (the "block pool with an LRU free queue" of the v1 KV cache manager). Two sentinel
nodes at the ends mean no operation ever has to test for "am I the first / last block?".
"""

from __future__ import annotations

from typing import Iterable, Iterator

from .block_pool import Block

__all__ = ["FreeBlockQueue"]


class FreeBlockQueue:
    """Doubly linked list of free blocks, `blocks` in the order they are to be handed out. A block
    is in it exactly when its links are set, so "is this block free?" is O(1) too."""

    def __init__(self, blocks: Iterable[Block] = ()):
        # Sentinels (module docstring): every queued block has a prev and a next, no special cases.
        self._head, self._tail = Block(-1), Block(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        """The free blocks from head (next to be allocated) to tail (most recently freed)."""
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> Block:
        """Take the block at the head (freed longest ago); IndexError if the queue is empty."""
        if self._length == 0:
            raise IndexError("popleft from an empty free block queue")
        block = self._head.next_free
        self.remove(block)
        return block

    def popleft_many(self, count: int) -> list[Block]:
        """Take `count` blocks from the head, in order (IndexError, taking none, if fewer)."""
        if count > self._length:
            raise IndexError(f"popleft of {count} blocks from a free block queue of "
                             f"{self._length}")
        taken = []
        head, block = self._head, self._head.next_free
        for _ in range(count):
            taken.append(block)
            block.prev_free, block = None, block.next_free
        for unlinked in taken:
            unlinked.next_free = None
        head.next_free, block.prev_free = block, head
        self._length -= count
        return taken

    def append(self, block: Block) -> None:
        """Put a block at the tail (reused last); ValueError if already queued (double free)."""
        if block.prev_free is not None:  # `block in self`, written out: it runs for every free
            raise ValueError(f"block {block.block_id} is already in the free block queue")
        last = self._tail.prev_free
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self._length += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from anywhere in the queue (ValueError if it is not in it)."""
        if block.prev_free is None:  # `block not in self`
            raise ValueError(f"block {block.block_id} is not in the free block queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._length -= 1
