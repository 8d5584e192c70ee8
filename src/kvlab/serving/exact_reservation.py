"""Exact-size reservations known in advance: contiguous (first fit) versus blocks.

The best case for contiguous KV memory: a server that knows, when it admits a request, exactly how
many tokens it will ever hold (prompt + max_output_tokens) and reserves precisely that many token
slots, adjacent, in one address space. Every slot reserved is one the request will reach by the
time it ends (no internal fragmentation), and still memory is lost: requests finish in a
different order than they started, the free slots end up scattered between the reservations that
remain, and the next request waits *although enough slots are free in total*. That is external
fragmentation (Kwon et al., *Efficient Memory Management for Large Language Model Serving with
PagedAttention*, SOSP 2023, section 3 and figure 3; the first-fit placement is the textbook one,
Knuth, *The Art of Computer Programming*, vol. 1, section 2.5).

Two `KVManager`s for the one scheduler (`kvlab.serving.scheduler`), identical in *how much* they
reserve and *when*, different only in *where*:

* `FirstFitSlabManager`: one contiguous run of exactly `reserve(request)` slots per request,
  placed at the first gap big enough (first fit). It counts the admissions it refused although the
  free slots added up would have held the request (`num_gap_refusals`).
* `ExactBlocksManager`: the same reservation rounded up to whole blocks of `block_size` tokens,
  taken from stage 4's block pool (`kvlab.paged.KVCacheManager`): any free blocks will do, so it
  never refuses for want of a gap.

Both reserve everything at admission, so `append` never fails and nothing is ever preempted; a
request for n > 1 completions is rejected on arrival (nothing here shares memory between forks).
"""

from __future__ import annotations

import bisect
from typing import Callable, NamedTuple

from ..paged.block_table import cdiv
from ..paged.kv_cache_manager import KVCacheManager
from .kv_managers import KVManager
from .request import Request

__all__ = ["FirstFitSlabManager", "ExactBlocksManager", "GapRefusal", "exact_size"]


def exact_size(request: Request) -> int:
    """Tokens a request will ever hold: prompt + max_output_tokens (a perfect length oracle)."""
    return request.total_len


class GapRefusal(NamedTuple):
    """One admission refused for want of a gap, although enough slots were free in total.

    Attributes:
        request_id: the request refused.
        size: token slots it asked for.
        free_tokens: free slots in total at that moment (>= size).
        gaps: the free gaps then, as (start slot, length) in address order (each < size).
        picture: the memory then, drawn by `FirstFitSlabManager.draw`.
    """

    request_id: int
    size: int
    free_tokens: int
    gaps: list[tuple[int, int]]
    picture: str


class _ExactReservation(KVManager):
    """What both managers share: `reserve(request)` token slots, checked, taken at admission.

    Args:
        capacity_tokens: token slots in the memory (>= 1).
        max_model_len: longest request accepted (>= 1).
        reserve: token slots to reserve for a request (default `exact_size`); must be at least
            the request's `total_len`, since the reservation is all it will ever have.

    Raises:
        ValueError: capacity_tokens < 1 or max_model_len < 1.
    """

    supports_forks = False  # one reservation per request: n > 1 is refused on arrival

    def __init__(self, capacity_tokens: int, max_model_len: int,
                 reserve: Callable[[Request], int] = exact_size):
        if capacity_tokens < 1 or max_model_len < 1:
            raise ValueError(f"need capacity_tokens >= 1 ({capacity_tokens}) and max_model_len "
                             f">= 1 ({max_model_len})")
        self.capacity_tokens, self.max_model_len, self.reserve = (capacity_tokens, max_model_len,
                                                                  reserve)

    def reservation(self, request: Request) -> int:
        """Token slots `request` reserves, in this memory's unit of allocation (slots or blocks
        x block_size).

        Raises:
            ValueError: `reserve` gave fewer slots than the request will hold (total_len): the
                request would write past its reservation. A bug in `reserve`, not in the request.
        """
        tokens = self.reserve(request)
        if tokens < request.total_len:
            raise ValueError(f"reserve() gave request {request.request_id} {tokens} token slots, "
                             f"fewer than the {request.total_len} it will hold")
        return tokens

    def reject_reason(self, request: Request) -> str | None:
        reason = super().reject_reason(request)
        if reason is None and self.reservation(request) > self.capacity_tokens:
            reason = (f"reserves {self.reservation(request):,} token slots > "
                      f"{self.capacity_tokens:,} in the whole memory")
        return reason



class FirstFitSlabManager(_ExactReservation):
    """One contiguous run of `reserve(request)` token slots per request, placed first fit.

    The memory is one address space of `capacity_tokens` slots, 0 .. capacity_tokens - 1. A request
    admitted gets the lowest-addressed gap that is big enough; when it finishes, its run becomes a
    gap again (merged with free neighbours, since a gap is just the space between two runs).
    Nothing is ever moved: compacting would mean copying the K/V of running requests.

    Args:
        capacity_tokens: token slots in the memory.
        max_model_len: longest request accepted.
        reserve: token slots per request (default `exact_size`: prompt + max_output_tokens).

    Attributes:
        runs: start slots of the reservations, ascending, and beside them `run_ends` (one past the
            last slot) and `run_owners` (request ids), index for index.
        num_refusals: admissions refused (no gap big enough), each counted, so a request that waits
            at the head of the queue for 5 steps counts 5.
        num_gap_refusals: of those, the ones where the free slots added up were enough: the
            request waited only because they were scattered (external fragmentation).
        gap_refused_requests: ids of the requests refused at least once for that reason.
        free_at_gap_refusals: free slots summed over the gap refusals (divide by
            num_gap_refusals for the free memory a waiting request could not use).
        worst_gap_refusal: the one with the most free slots, as a `GapRefusal` (None until
            one happens): the clearest picture of memory free but unusable.

    Raises:
        ValueError: capacity_tokens < 1 or max_model_len < 1.
    """

    name = "exact slabs"

    def __init__(self, capacity_tokens: int, max_model_len: int,
                 reserve: Callable[[Request], int] = exact_size):
        super().__init__(capacity_tokens, max_model_len, reserve)
        self.runs: list[int] = []
        self.run_ends: list[int] = []
        self.run_owners: list[int] = []
        self.holding: set[int] = set()  # run_owners as a set (`holds` is asked every step)
        self.num_reserved = 0
        self.num_refusals = self.num_gap_refusals = self.free_at_gap_refusals = 0
        self.gap_refused_requests: set[int] = set()
        self.worst_gap_refusal: GapRefusal | None = None

    @property
    def num_free_tokens(self) -> int:
        """Free slots in total, wherever they are."""
        return self.capacity_tokens - self.num_reserved

    def gaps(self) -> list[tuple[int, int]]:
        """The free gaps as (start slot, length), in address order."""
        out, end = [], 0
        for start, run_end in zip(self.runs, self.run_ends):
            if start > end:
                out.append((end, start - end))
            end = run_end
        if self.capacity_tokens > end:
            out.append((end, self.capacity_tokens - end))
        return out

    def first_fit(self, size: int) -> int | None:
        """Start slot of the first gap of at least `size` slots, or None (nothing changes)."""
        for start, length in self.gaps():
            if length >= size:
                return start
        return None

    def holds(self, request: Request) -> bool:
        return request.request_id in self.holding

    def admit(self, request: Request) -> bool:
        size = self.reservation(request)
        start = self.first_fit(size)
        if start is None:  # count why, and change nothing else
            self.num_refusals += 1
            if self.num_free_tokens >= size:
                self.num_gap_refusals += 1
                self.free_at_gap_refusals += self.num_free_tokens
                self.gap_refused_requests.add(request.request_id)
                worst = self.worst_gap_refusal
                if worst is None or self.num_free_tokens > worst.free_tokens:
                    self.worst_gap_refusal = GapRefusal(request.request_id, size,
                                                        self.num_free_tokens, self.gaps(),
                                                        self.draw())
            return False
        index = bisect.bisect(self.runs, start)
        self.runs.insert(index, start)
        self.run_ends.insert(index, start + size)
        self.run_owners.insert(index, request.request_id)
        self.num_reserved += size
        self.holding.add(request.request_id)
        return True

    def free(self, request: Request) -> None:
        self.holding.remove(request.request_id)
        index = self.run_owners.index(request.request_id)
        self.num_reserved -= self.run_ends[index] - self.runs[index]
        del self.runs[index], self.run_ends[index], self.run_owners[index]

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_reserved

    def draw(self, width: int = 64) -> str:
        """The memory as `width` characters, each standing for capacity / width slots: '#' all
        reserved, '.' all free, '+' partly both (to see the gaps at a glance)."""
        cells = [0] * width  # reserved slots per character
        per_cell = self.capacity_tokens / width
        for start, end in zip(self.runs, self.run_ends):
            for cell in range(int(start // per_cell), min(width, int(-(-end // per_cell)))):
                low, high = cell * per_cell, (cell + 1) * per_cell
                cells[cell] += max(0.0, min(end, high) - max(start, low))
        return "".join("#" if held >= per_cell - 1e-9 else "." if held == 0 else "+"
                       for held in cells)


class ExactBlocksManager(_ExactReservation):
    """The same reservation as `FirstFitSlabManager`, rounded up to whole blocks, taken from a
    block pool at admission: any free blocks will do, wherever they are.

    Args:
        manager: the block bookkeeping (`kvlab.paged.KVCacheManager`), empty.
        max_model_len: longest request accepted.
        reserve: token slots per request before rounding (default `exact_size`).

    It differs from the paged `KVCacheManager` (stage 4's paging) only in *when* blocks are taken: all of a
    request's blocks at admission, not one at a time as it grows, so that a comparison with the
    first-fit slabs changes the placement alone.

    Raises:
        ValueError: max_model_len < 1.
    """

    name = "exact blocks"

    def __init__(self, manager: KVCacheManager, max_model_len: int,
                 reserve: Callable[[Request], int] = exact_size):
        super().__init__(manager.pool.num_blocks * manager.block_size, max_model_len, reserve)
        self.manager, self.block_size = manager, manager.block_size

    def reservation(self, request: Request) -> int:
        return cdiv(super().reservation(request), self.block_size) * self.block_size

    def holds(self, request: Request) -> bool:
        return request.request_id in self.manager.tables

    def admit(self, request: Request) -> bool:
        # the manager checks for enough free blocks before it changes anything
        return self.manager.allocate_slots(request, self.reservation(request)) is not None

    def free(self, request: Request) -> None:
        self.manager.free(request)

    @property
    def num_reserved_tokens(self) -> int:
        return self.manager.num_used_blocks * self.block_size
