"""The KV cache manager: the block tables of all requests over one block pool.

vLLM v1 splits a server into a scheduler that decides, this manager that allocates, and a model
runner that executes. The scheduler calls the manager directly, with the request itself; nothing
here touches a tensor. Its verbs:

* `get_computed_blocks(request)`: blocks already holding the request's leading tokens, and how
  many tokens they cover (none here; stage 6's prefix cache finds some);
* `allocate_slots(request, num_new_tokens, ...)`: room for the tokens a step computes, at
  admission (after those computed blocks) or later, a new block only at a block boundary; the new
  block ids (possibly none), or None when the pool has no room now, changing nothing;
* `free(request)`: it finished, or is preempted (recompute: the scheduler sets its
  num_computed_tokens back to 0; Kwon et al., SOSP 2023, section 4.5). Blocks go back tail first,
  as in vLLM v1: the tail is the part least likely shared by a later request (stage 6);
* `fork(parent, child)`: a child (parallel sampling, n > 1) shares all its parent's blocks.

Copy-on-write (section 4.4): after a fork, parent and child hold the same blocks, ref count 2.
Full blocks are never written again, but a partly filled shared last block would be: so before
that write `allocate_slots` gives the writer a fresh block and records (src, dst), and
`take_copies()` hands the pairs to the model runner, which copies the K/V in every layer before
the forward pass (vLLM v0's `blocks_to_copy`).

The forward pass computes its slot mapping once, from the block tables
(`PagedKVCache.batch_store`). What a learner prints of the tables is in `manager_views`.

`num_shared_tokens` counts the token slots more than one table holds, once per holder after the
first (a fork shares its parent's slots; stage 6's cache hits share full blocks), so that a count
of tokens request by request, less it, counts each slot once (the engine's "used" figure).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..errors import RequestTooLongError
from ..checks import check_int
from .block_pool import BlockPool
from .block_table import BlockTable, cdiv
from .budget import check_pool_fits
from .manager_views import ManagerViews

__all__ = ["KVCacheManager", "too_long_reason"]


def too_long_reason(request, max_model_len: int) -> str | None:
    """Why a request is longer than max_model_len (numbers in the text), or None."""
    if request.total_len > max_model_len:
        return (f"{request.prompt_len} prompt + {request.max_output_tokens} output = "
                f"{request.total_len} tokens > max_model_len={max_model_len}")
    return None


class KVCacheManager(ManagerViews):
    """Block tables per request over one `BlockPool` (vLLM's default block_size is 16; section
    7.2 weighs it); max_model_len defaults to the whole pool. ValueError: a size not a positive
    integer. KVCacheOutOfMemory: the pool cannot hold one max_model_len request."""

    name = "paged"
    has_prefix_cache = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int | None = None):
        self.block_size = check_int("block_size", block_size, 1)
        self.pool = BlockPool(num_blocks)
        self.capacity_tokens = num_blocks * block_size
        if max_model_len is None:
            max_model_len = self.capacity_tokens
        self.max_model_len = check_int("max_model_len", max_model_len, 1)
        check_pool_fits(num_blocks, block_size, max_model_len)
        self.tables: dict[Hashable, BlockTable] = {}  # request_id -> its block table
        self.num_cow_copies = 0  # blocks copied by copy-on-write since start-up
        self.num_shared_tokens = 0  # slots held by several tables, once per extra holder
        self._copies: list[tuple[int, int]] = []  # since the last take_copies

    # ---- the scheduler's verbs ---------------------------------------------------------------

    def reject_reason(self, request) -> str | None:
        """Why this request can never be served (checked once, on arrival), or None."""
        reason = too_long_reason(request, self.max_model_len)
        blocks = cdiv(request.total_len, self.block_size)
        if reason is None and blocks > self.pool.num_blocks:
            reason = (f"{request.total_len} tokens = {blocks} blocks of {self.block_size} > the "
                      f"whole pool of {self.pool.num_blocks} blocks")
        return reason

    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """Blocks already holding the request's leading tokens, and their token count: none."""
        return [], 0

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[int] = (),
                       full_sequence_must_fit: bool = False) -> list[int] | None:
        """The new block ids, a copy-on-write copy first. full_sequence_must_fit: at admission,
        refuse unless the free blocks could hold all of the request's tokens now
        (`scheduler_reserve_full_isl`). ValueError: a count not an integer >= 0, computed blocks
        that do not hold exactly num_new_computed_tokens, or given after admission.
        RequestTooLongError: the request would outgrow the whole pool."""
        table = self.tables.get(request.request_id)
        if table is not None and not new_computed_blocks:
            # Most decode tokens land in a free slot of an unshared last block: no block to take.
            if (type(num_new_tokens) is int
                    and len(table.block_ids) * self.block_size - table.num_tokens
                    >= num_new_tokens >= 0
                    and self.pool.blocks[table.block_ids[-1]].ref_count == 1):
                table.num_tokens += num_new_tokens
                return []
        num_new_tokens = check_int("num_new_tokens", num_new_tokens, 0)
        admitting = table is None
        if admitting:
            computed = check_int("num_new_computed_tokens", num_new_computed_tokens, 0)
            if computed != len(new_computed_blocks) * self.block_size:
                raise ValueError(f"num_new_computed_tokens={computed}, but the "
                                 f"{len(new_computed_blocks)} computed blocks of "
                                 f"{self.block_size} hold "
                                 f"{len(new_computed_blocks) * self.block_size}")
            if computed + num_new_tokens < 1:
                raise ValueError(f"request {request.request_id!r} is admitted with no token")
            table = BlockTable(self.block_size, list(new_computed_blocks), computed)
        elif new_computed_blocks or num_new_computed_tokens:
            raise ValueError(f"request {request.request_id!r} already has a block table: "
                             f"computed blocks are given at admission only")
        self._check_fits(request, table, num_new_tokens)
        copy = num_new_tokens > 0 and self._must_copy_last_block(table)
        num_blocks = table.num_blocks_after(num_new_tokens)
        pool = self.pool
        touched = pool.num_free_to_touch(new_computed_blocks)  # free hits leave the queue too
        if num_blocks + copy + touched > pool.num_free_blocks:
            return None
        if admitting and full_sequence_must_fit and (
                cdiv(request.num_tokens, self.block_size) - len(new_computed_blocks) + touched
                > pool.num_free_blocks):
            return None
        # Computed blocks another request holds now have one more holder (all full blocks).
        self.num_shared_tokens += self.block_size * sum(
            1 for block_id in new_computed_blocks if pool.blocks[block_id].ref_count)
        pool.touch(new_computed_blocks)  # first: allocation below must not reuse them
        new_blocks = []
        if copy:
            self.num_shared_tokens -= table.num_tokens % self.block_size  # its own block now
            [new_block] = pool.allocate(1)
            old_block, table.block_ids[-1] = table.block_ids[-1], new_block
            pool.release([old_block])  # the siblings keep it; this request now has its own
            self._copies.append((old_block, new_block))
            self.num_cow_copies += 1
            new_blocks.append(new_block)
        new_blocks += pool.allocate(num_blocks)
        table.block_ids += new_blocks[copy:]
        table.num_tokens += num_new_tokens
        if admitting:
            self.tables[request.request_id] = table  # only now, after the allocation succeeded
        return new_blocks

    def free(self, request) -> None:
        """Release the request's blocks, tail first. KeyError: it holds no block table."""
        table = self._table(request.request_id)
        if self.num_shared_tokens:  # its slots in blocks others hold too are theirs alone now
            blocks = self.pool.blocks
            self.num_shared_tokens -= sum(table.tokens_in_block(index)
                                          for index, block_id in enumerate(table.block_ids)
                                          if blocks[block_id].ref_count > 1)
        self.pool.release(reversed(table.block_ids))
        del self.tables[request.request_id]

    def fork(self, parent, child) -> None:
        """The child shares every block of the parent (ref count + 1 each, no copy). KeyError:
        unknown parent. ValueError: the child already has a block table."""
        table = self._table(parent.request_id)
        if child.request_id in self.tables:
            raise ValueError(f"request {child.request_id!r} already has a block table")
        for block_id in table.block_ids:
            self.pool.share(block_id)
        self.num_shared_tokens += table.num_tokens  # every slot gains a holder
        self.tables[child.request_id] = BlockTable(self.block_size, list(table.block_ids),
                                                   table.num_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) blocks to copy before the next forward pass (copy-on-write), then forgotten."""
        copies, self._copies = self._copies, []
        return copies

    # ---- internals ---------------------------------------------------------------------------

    def _table(self, request_id: Hashable) -> BlockTable:
        try:
            return self.tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: it has no block table (never "
                           f"allocated, or already freed)") from None

    def _must_copy_last_block(self, table: BlockTable) -> bool:
        """The next token lands in a partly filled block that another request also holds."""
        return (table.num_tokens % self.block_size != 0
                and self.pool.ref_count(table.block_ids[-1]) > 1)

    def _check_fits(self, request, table: BlockTable, num_new_tokens: int) -> None:
        total = table.num_tokens + num_new_tokens
        if cdiv(total, self.block_size) > self.pool.num_blocks:
            raise RequestTooLongError(
                f"request {request.request_id!r} would hold {total} tokens = "
                f"{cdiv(total, self.block_size)} blocks of {self.block_size}, more than the whole "
                f"pool of {self.pool.num_blocks} blocks ({self.capacity_tokens} tokens)")

    # ---- what the engine records of each step ----------------------------------------------

    @property
    def num_reserved_tokens(self) -> int:
        """Slots of the blocks requests hold (cached blocks nobody holds are free memory)."""
        return self.pool.num_used_blocks * self.block_size
