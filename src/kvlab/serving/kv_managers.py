"""The one small interface between the scheduler and KV memory, and a manager per strategy.

vLLM v1 splits a server into a scheduler that decides, a KV cache manager that allocates, and a
model runner that executes. The scheduler never sees a block or a byte: it asks the manager a few
questions and acts on the answers. Every strategy of the course answers the same questions:

* `reject_reason(request)`: can this request *never* fit (max_model_len, the whole memory)?
* `allocate(request, token_budget)`: admit it, holding memory for the tokens it computes first (at
  most `token_budget`); returns how many of its tokens were found already cached (prefix caching;
  else 0), or None if there is no room now (nothing changes).
* `append(request, num_new_tokens)`: room for more tokens of a running request; False if none now.
* `free(request)`: it finished; `preempt(request)`: evict it to recompute later (returns tokens lost).
* `fork(parent, child)`: a sibling of a request for n > 1 completions takes over the parent's
  computed prompt (paged: the same blocks, shared; contiguous: a slab of its own, copied).
* `take_copies()`: blocks to copy before the next forward pass (copy-on-write of a shared last
  block; vLLM v0's `blocks_to_copy`), handed to the runner with the step.
* `num_reserved_tokens`, `capacity_tokens`, `usage()`: what is held, out of what.

`ContiguousManager` is stage 2's reservation: a max_model_len slab per request, taken whole at
admission. `PagedManager` is stage 4's block pool (`kvlab.paged.KVCacheManager`): blocks taken as a
request grows. Token counts are the unit; bytes are tokens x KV bytes per token.
"""

from __future__ import annotations

import abc

from ..paged.block_table import cdiv
from ..errors import KVCacheOutOfMemory, NoFreeBlocksError
from ..paged.budget import check_pool_fits
from ..paged.kv_cache_manager import KVCacheManager
from .request import Request

__all__ = ["KVManager", "ContiguousManager", "PagedManager", "SlotlessKVCacheManager"]


class KVManager(abc.ABC):
    """What a scheduler may ask of KV memory. Every method that fails changes no state.

    Attributes:
        name: the strategy's name in tables ('contiguous', 'paged', ...).
        max_model_len: longest request (prompt + max_output_tokens) the server accepts.
        capacity_tokens: token slots in the whole KV budget.
        has_prefix_cache: whether `allocate` can find cached tokens.
    """

    name: str
    max_model_len: int
    capacity_tokens: int
    has_prefix_cache = False  # True when `allocate` can find cached tokens
    # False for a design that holds one sequence per request (nothing to share between the n
    # completions of one prompt): requests with forks are then refused on arrival.
    supports_forks = True

    def reject_reason(self, request: Request) -> str | None:
        """Why this request can never be served, or None. Checked once, on arrival."""
        if request.total_len > self.max_model_len:
            return (f"{request.prompt_len} prompt + {request.max_output_tokens} output = "
                    f"{request.total_len} tokens > max_model_len={self.max_model_len}")
        if request.forks and not self.supports_forks:
            return (f"n = {request.num_seqs} completions: the {self.name} strategy holds one "
                    f"sequence per request (nothing to share between them)")
        return None

    @abc.abstractmethod
    def allocate(self, request: Request, token_budget: int) -> int | None:
        """Admit a request (nothing computed yet): hold room for its first
        min(num_tokens - cached, token_budget) tokens, where cached (returned) counts its leading
        tokens found in a prefix cache, at most num_tokens - 1. None: no room now."""

    @abc.abstractmethod
    def append(self, request: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a running request."""

    @abc.abstractmethod
    def free(self, request: Request) -> None:
        """A finished request lets go of its memory."""

    @abc.abstractmethod
    def preempt(self, request: Request) -> int:
        """Evict a running request (recompute later); returns the tokens whose K/V are dropped."""

    def fork(self, parent: Request, child: Request) -> None:
        """`child` (one of `parent.forks`, admitted with it) takes over the parent's computed
        tokens; called right after the parent's prompt is computed. A strategy with
        supports_forks = False never gets here (such requests are refused on arrival)."""
        raise RuntimeError(f"the {self.name} strategy never forks: a request for n > 1 "
                           f"completions is refused on arrival")

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) blocks to copy before the next forward pass, then forgotten."""
        return []

    @property
    @abc.abstractmethod
    def num_reserved_tokens(self) -> int:
        """Token slots held by requests now (used or not)."""

    def usage(self) -> float:
        """Share of the KV budget held now, 0 .. 1 (vLLM's `kv_cache_usage`)."""
        return self.num_reserved_tokens / self.capacity_tokens


class ContiguousManager(KVManager):
    """Stage 2: every admitted request holds one slab of max_model_len token slots until it ends.

    Args:
        num_slabs: slabs the budget holds (= budget bytes // (max_model_len x KV bytes per token)).
        max_model_len: tokens per slab.

    The slabs are all one size, so any free slab serves any request: no external fragmentation,
    but a request of 300 tokens holds 4,096 slots (internal fragmentation, vLLM paper section 3).

    Raises:
        KVCacheOutOfMemory: num_slabs < 1 (the budget cannot hold one max_model_len request; the
            message says so).
        ValueError: max_model_len < 1.
    """

    name = "contiguous"

    def __init__(self, num_slabs: int, max_model_len: int):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if num_slabs < 1:
            raise KVCacheOutOfMemory(f"the KV budget holds no slab of max_model_len="
                                     f"{max_model_len} tokens; lower max_model_len or give the "
                                     f"cache more memory")
        self.num_slabs, self.max_model_len = num_slabs, max_model_len
        self.capacity_tokens = num_slabs * max_model_len
        # request id -> slabs it holds: 1, or 1 + its forks until they are made (each fork takes
        # one of its parent's; a copy of the prompt goes into it, nothing is shared)
        self.holders: dict[int, int] = {}
        self.num_held = 0

    def allocate(self, request: Request, token_budget: int) -> int | None:
        if self.num_held + request.num_seqs > self.num_slabs:
            return None
        self.holders[request.request_id] = request.num_seqs
        self.num_held += request.num_seqs
        return 0

    def append(self, request: Request, num_new_tokens: int) -> bool:
        return True  # the slab was sized for max_model_len at admission

    def free(self, request: Request) -> None:
        self.num_held -= self.holders.pop(request.request_id)

    def preempt(self, request: Request) -> int:
        self.free(request)
        return request.num_computed_tokens

    def fork(self, parent: Request, child: Request) -> None:
        if self.holders.get(parent.request_id, 0) < 2:
            raise RuntimeError(f"request {parent.request_id} holds no slab for its fork "
                               f"{child.request_id}")
        self.holders[parent.request_id] -= 1
        self.holders[child.request_id] = 1

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_held * self.max_model_len


class PagedManager(KVManager):
    """Stage 4: blocks of `block_size` tokens, taken only when a request crosses a block boundary.

    Args:
        manager: the block bookkeeping, `kvlab.paged.KVCacheManager`. In model mode pass the
            manager of the `PagedKVCache` the model reads, so the scheduler's decisions and the
            tensors agree; in simulation a bare one.
        max_model_len: longest request accepted (the pool must hold one; checked here).

    Raises:
        KVCacheOutOfMemory: the pool cannot hold one max_model_len request (vLLM's start-up
            check, `kvlab.paged.budget.check_pool_fits`, as `PagedKVCache` does).
    """

    name = "paged"

    def __init__(self, manager: KVCacheManager, max_model_len: int):
        self.manager, self.max_model_len = manager, max_model_len
        self.block_size = manager.block_size
        self._pool_blocks = manager.pool.blocks  # ref counts, read on the fast path of `append`
        self.capacity_tokens = manager.pool.num_blocks * self.block_size
        self._copies: list[tuple[int, int]] = []  # copy-on-write since the last take_copies
        check_pool_fits(manager.pool.num_blocks, self.block_size, max_model_len)

    def allocate(self, request: Request, token_budget: int) -> int | None:
        try:
            self.manager.allocate(request.request_id, min(request.num_tokens, token_budget))
        except NoFreeBlocksError:
            return None
        return 0

    def append(self, request: Request, num_new_tokens: int) -> bool:
        # Most decode tokens land in a free slot of the last block and need no new block: count
        # those here without building a slot list (it keeps the 19,366-request replay fast). A
        # shared last block (ref count > 1) takes the manager's path, which copies it on write.
        table = self.manager.tables[request.request_id]
        last_block = table.block_ids[-1]
        if (len(table.block_ids) * self.block_size - table.num_tokens >= num_new_tokens
                and self._pool_blocks[last_block].ref_count == 1):
            table.num_tokens += num_new_tokens
            return True
        try:
            reservation = self.manager.append_slots(request.request_id, num_new_tokens)
        except NoFreeBlocksError:
            return False
        self._copies += reservation.copies  # a forked sibling's first write to a shared block
        return True

    def free(self, request: Request) -> None:
        self.manager.free(request.request_id)

    def preempt(self, request: Request) -> int:
        return self.manager.preempt(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        # The child's table points at the parent's blocks (ref count + 1): no block is taken and
        # nothing is copied until one of them writes into a shared partial block.
        self.manager.fork(parent.request_id, child.request_id)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    @property
    def num_reserved_tokens(self) -> int:
        """Slots of blocks held by requests (with a prefix cache, cached blocks that nobody holds
        are free memory: they are not counted)."""
        return self.manager.num_used_blocks * self.block_size


class SlotlessKVCacheManager(KVCacheManager):
    """`KVCacheManager` for simulation: the same blocks, but no slot lists are built.

    `allocate` and `append_slots` return the slots of the new tokens, which only a forward pass
    needs; building them for a 1,000-token prompt costs more than the rest of the step. Every
    decision (which blocks, when the pool is dry) is the parent's.
    """

    def _reserve(self, table, num_new_tokens: int) -> list[int]:
        table.num_tokens += num_new_tokens
        return []
