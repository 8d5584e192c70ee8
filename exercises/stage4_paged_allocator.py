# Stage 4 exercise, generated from solutions/stage4_paged_allocator.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 4`.

"""Stage 4 exercise: fork and copy-on-write, so that n completions of one prompt share its blocks.

Notebook 04 writes a KV cache manager with vLLM v1's verbs: `allocate_slots(request,
num_new_tokens)` gives a request the slots for its next tokens, taking a block from the free block
queue only when a block boundary is crossed, and `free(request)` gives its blocks back. Each block
has a ref count, the number of block tables that hold it, but no two tables ever hold the same
block there. Notebook 04b shares them: parallel sampling (n > 1) prefills the prompt once and
*forks* the request, so n block tables point at the prompt's blocks (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023, section 4.4). `fork` is
vLLM v0's block-manager verb and the name of SGLang's frontend primitive (`s.fork(n)`); vLLM v1
instead runs n child requests whose prompts share full blocks through its prefix cache (stage 6).
kvlab keeps `fork`.

A full block is never written again, so sharing it is safe for good. A partly filled last block is
not: the next token of either sibling lands in it. Copy-on-write: the first sibling to write there
gets a fresh block holding a copy of the shared one. The manager only decides; it records (source, destination) and the model runner copies the K/V of
every layer before the forward pass (`take_copies`, vLLM v0's `blocks_to_copy`).

`ForkingKVCacheManager` below is the page's manager with copy-on-write wired into
`allocate_slots`, which counts the copy's block before it takes any. You write what it calls:
`_must_copy_last_block` (when a copy is needed), `_copy_last_block` (the copy), and `fork`.
`kvlab check 4` replays the same calls on kvlab's `kvlab.paged.KVCacheManager` and compares block
ids, tables, ref counts and copies after each one. Read `src/kvlab/paged/kv_cache_manager.py`
afterwards and compare.

Units: token counts are numbers of tokens; block ids are ints 0 .. num_blocks - 1. A request is
any object with a hashable `request_id` (kvlab.serving.Request, or types.SimpleNamespace).
"""

from __future__ import annotations

import collections
from typing import Hashable


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: blocks needed for `numerator` tokens of `denominator` per block."""
    return -(-numerator // denominator)


class ForkingKVCacheManager:
    """Block tables of many requests over one pool of `num_blocks` blocks of `block_size` tokens.

    The state your methods keep consistent (notebook 04's names):

    Attributes:
        block_size: token slots per block.
        free_block_queue: ids of the blocks no block table holds. Blocks are taken from its head
            (`popleft`: block 0 first on a fresh pool); freed ones join its tail (`free`).
        ref_counts: ref_counts[b] = how many block tables hold block b: 0 exactly when b is in the
            free block queue, > 1 while forked requests share it.
        block_tables: request_id -> its block ids in logical order (entry i holds positions
            i * block_size .. (i + 1) * block_size - 1). Two requests may list the same block.
        num_tokens: request_id -> token slots the request holds (positions 0 .. num_tokens - 1);
            only its last block can be partly filled.
        copies: (source, destination) block pairs of the copy-on-writes since the last
            `take_copies`, in the order they happened.

    A call that refuses (returns None) or raises leaves every attribute exactly as it was.

    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got num_blocks="
                             f"{num_blocks}, block_size={block_size}")
        self.block_size = block_size
        self.free_block_queue: collections.deque[int] = collections.deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        self.num_tokens: dict[Hashable, int] = {}
        self.copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def _take(self, count: int) -> list[int]:
        """`count` blocks from the head of the free block queue, ref count 1 each (the caller has
        checked that enough are free)."""
        blocks = [self.free_block_queue.popleft() for _ in range(count)]
        for block_id in blocks:
            self.ref_counts[block_id] = 1
        return blocks

    def allocate_slots(self, request, num_new_tokens: int) -> list[int] | None:
        """Slots for `num_new_tokens` more tokens of `request` (a new one is admitted).

        The page's `allocate_slots`, plus copy-on-write: when `_must_copy_last_block` says so, this
        request first gets a block of its own for its last one (`_copy_last_block`). The copy
        takes a free block too, so it is counted before anything changes.

        Returns:
            The blocks taken, in the order taken (the copy's destination first), [] if none, or
            None when fewer blocks are free than the call needs, copy included (nothing changed).

        Raises:
            ValueError: num_new_tokens < 0, or a new request with 0 tokens.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        request_id = request.request_id
        if request_id not in self.block_tables and num_new_tokens == 0:
            raise ValueError(f"request {request_id!r} is admitted with no token")
        held = self.num_tokens.get(request_id, 0)
        past_the_end = cdiv(held + num_new_tokens, self.block_size) - len(
            self.block_tables.get(request_id, []))
        must_copy = num_new_tokens > 0 and self._must_copy_last_block(request_id)
        if must_copy + past_the_end > len(self.free_block_queue):
            return None  # the copy needs a free block as well; nothing has changed
        copied = [self._copy_last_block(request_id)] if must_copy else []
        new_blocks = self._take(past_the_end)  # as on the page: from the queue's head
        self.block_tables[request_id] = self.block_tables.get(request_id, []) + new_blocks
        self.num_tokens[request_id] = held + num_new_tokens
        return copied + new_blocks

    def _must_copy_last_block(self, request_id) -> bool:
        """True exactly when writing this request's next token in place would change K/V that
        another request reads, so that the request needs a block of its own first. False for a
        request with no block table. Changes nothing.
        """
        raise NotImplementedError("TODO(stage 4): which block does the token at position num_tokens land in, and who else reads that block?")

    def _copy_last_block(self, request_id) -> int:
        """Copy-on-write. Afterwards this request's table ends in a fresh block (one `_take`)
        where the shared last block was, and:

        * every block's ref count equals the number of block tables that list it;
        * every other request's table is as it was;
        * `copies` ends with one more (source, destination) pair: the model runner copies the
          source block's K/V into the destination before the forward pass.

        The caller has checked that a block is free.

        Returns:
            The fresh block's id.
        """
        raise NotImplementedError("TODO(stage 4): which block lost an owner, and which K/V must the fresh block start with?")

    def fork(self, parent, child) -> None:
        """Start `child` as a second completion of `parent`'s tokens (paper section 4.4).

        Afterwards the child holds the parent's tokens in the parent's blocks; no block was taken
        and no K/V copied (what parallel sampling saves); every block's ref count equals the
        number of block tables that list it; and growing either table later leaves the other as
        it is. Works for any parent: a fresh request, a fork, or one that has copied.

        Raises:
            KeyError: the parent holds no block table.
            ValueError: the child already holds one.
            A call that raises changes nothing.
        """
        raise NotImplementedError("TODO(stage 4): check before you change anything")

    def free(self, request) -> None:
        """The request finished (or is preempted): each of its blocks loses one owner, and a block
        nobody holds any more joins the free block queue's tail, the table's last block first
        (vLLM v1's order). A block a sibling still holds stays where it is. KeyError: unknown."""
        for block_id in reversed(self.block_tables.pop(request.request_id)):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_queue.append(block_id)
        del self.num_tokens[request.request_id]

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) pairs to copy before the next forward pass, then forgotten."""
        copies, self.copies = self.copies, []
        return copies
