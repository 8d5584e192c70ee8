"""Reserve at admission: every design before paging, one manager base and its placements.

Before paged attention a server reserved all of a request's KV memory at admission, sized for the
most tokens it could reach, and held it until the request ended (Kwon et al., *Efficient Memory
Management for Large Language Model Serving with PagedAttention*, SOSP 2023, section 3). Such a
manager answers the scheduler's verbs (vLLM v1's, `kvlab.paged.KVCacheManager`) simply:
`allocate_slots` takes the whole reservation on the request's first call (None: no room now) and
returns [] after; nothing is ever computed already; preemption is `free`.

`KVManager` is that idea once. The designs differ in *how much* (a size function: `exact_size`, a
perfect length oracle; `power_of_two`, Orca's Pow2; or a max_model_len slab) and *where* (the
subclass): `ContiguousManager`, stage 2's equal slabs, so any free one will do (no external
fragmentation, but a request of 300 tokens holds 4,096 slots); `FirstFitSlabManager`, adjacent
slots at the first gap big enough (`kvlab.paged.fragmentation.first_fit`, Knuth vol. 1, section
2.5), counting the refusals where the free slots added up would have held the request (external
fragmentation, the paper's figure 3); `ExactBlocksManager`, the same size in whole blocks from
stage 4's pool; and on a GPU `kvlab.tools.oom_story.naive.NaiveManager`, one tensor per request
placed by the CUDA caching allocator. The unit is tokens (x KV bytes per token for bytes).
"""

from __future__ import annotations

import abc
import bisect
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ..errors import KVCacheOutOfMemory
from ..paged.block_table import cdiv
from ..paged.fragmentation import first_fit
from ..paged.kv_cache_manager import KVCacheManager, too_long_reason
from .request import Request

if TYPE_CHECKING:  # simulation runs without torch
    from ..contiguous import ContiguousKVCache

__all__ = ["KVManager", "ContiguousManager", "FirstFitSlabManager", "ExactBlocksManager",
           "GapRefusal", "exact_size", "power_of_two"]


def exact_size(request: Request) -> int:
    """Tokens a request will ever hold: prompt + max_output_tokens (a perfect length oracle)."""
    return request.total_len


def power_of_two(request: Request) -> int:
    """Token slots of Orca's Pow2 reservation (Kwon et al., SOSP 2023, section 6.1): the prompt,
    plus the output rounded up to a power of two (25 output tokens reserve 32)."""
    return request.prompt_len + (1 << (request.max_output_tokens - 1).bit_length())


class KVManager(abc.ABC):
    """Reserves a request's memory whole, at admission: `capacity_tokens` slots in the budget,
    requests of up to `max_model_len` tokens, `reserve(request)` slots each (default `exact_size`;
    at least its `total_len`, all it will ever have). ValueError: either count < 1."""

    name: str
    has_prefix_cache = False
    # False: one sequence per request, so a request for n > 1 completions is refused on arrival.
    supports_forks = False

    def __init__(self, capacity_tokens: int, max_model_len: int,
                 reserve: Callable[[Request], int] = exact_size):
        if capacity_tokens < 1 or max_model_len < 1:
            raise ValueError(f"need capacity_tokens >= 1 ({capacity_tokens}) and max_model_len "
                             f">= 1 ({max_model_len})")
        self.capacity_tokens, self.max_model_len, self.reserve = (capacity_tokens, max_model_len,
                                                                  reserve)

    def reservation(self, request: Request) -> int:
        """Token slots `request` reserves, in this memory's unit of allocation, at most a
        max_model_len slab (what Orca's Max reserves). ValueError: `reserve` gave fewer slots than
        the request will hold (a bug in `reserve`)."""
        tokens = min(self.reserve(request), self.max_model_len)
        if tokens < request.total_len:
            raise ValueError(f"reserve() gave request {request.request_id} {tokens} token slots, "
                             f"fewer than the {request.total_len} it will hold")
        return tokens

    def reject_reason(self, request: Request) -> str | None:
        """Why this request can never be served, or None. Checked once, on arrival."""
        reason = too_long_reason(request, self.max_model_len)
        if reason is None and request.forks and not self.supports_forks:
            reason = (f"n = {request.num_seqs} completions: the {self.name} strategy holds one "
                      f"sequence per request (nothing to share between them)")
        return reason if reason is not None else self.too_big_reason(request)

    def too_big_reason(self, request: Request) -> str | None:
        """Why the reservation would not fit even an empty memory, or None."""
        if self.reservation(request) > self.capacity_tokens:
            return (f"reserves {self.reservation(request):,} token slots > "
                    f"{self.capacity_tokens:,} in the whole memory")
        return None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Nothing is ever found computed."""
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[int] = (),
                       full_sequence_must_fit: bool = False) -> list[int] | None:
        """The reservation at the request's first call ([], or None: no room now); [] after.
        (A reservation always holds the whole request: full_sequence_must_fit changes nothing.)"""
        if self.holds(request):
            return []
        return [] if self.admit(request) else None

    @abc.abstractmethod
    def holds(self, request: Request) -> bool:
        """The request has its reservation."""

    @abc.abstractmethod
    def admit(self, request: Request) -> bool:
        """Take the request's reservation; False (nothing changed) if it does not fit now."""

    @abc.abstractmethod
    def free(self, request: Request) -> None:
        """The request (finished or preempted) lets go of its reservation."""

    def fork(self, parent: Request, child: Request) -> None:
        raise RuntimeError(f"the {self.name} strategy never forks: a request for n > 1 "
                           f"completions is refused on arrival")

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    @property
    @abc.abstractmethod
    def num_reserved_tokens(self) -> int:
        """Token slots held by requests now (used or not)."""

    def usage(self) -> float:
        """Share of the KV budget held now, 0 .. 1 (vLLM's `kv_cache_usage`)."""
        return self.num_reserved_tokens / self.capacity_tokens


class ContiguousManager(KVManager):
    """Stage 2: every admitted request holds one slab of max_model_len token slots until it ends;
    `num_slabs` = budget bytes // (max_model_len x KV bytes per token). In model mode `cache` is
    the slabs' tensors (stage 2's `ContiguousKVCache`, of num_slabs slabs): this manager claims,
    forks and frees them, and `slab_of` says which slab each request holds; in simulation it only
    counts. KVCacheOutOfMemory: num_slabs < 1; ValueError: max_model_len < 1."""

    name = "contiguous"
    supports_forks = True  # a fork takes a slab of its own, a copy of the prompt

    def __init__(self, num_slabs: int, max_model_len: int, cache: ContiguousKVCache | None = None):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if num_slabs < 1:
            raise KVCacheOutOfMemory(f"the KV budget holds no slab of max_model_len="
                                     f"{max_model_len} tokens; lower max_model_len or give the "
                                     f"cache more memory")
        super().__init__(num_slabs * max_model_len, max_model_len, self._slab)
        self.num_slabs, self.cache = num_slabs, cache
        # request id -> slabs held: 1, plus one per fork not yet made (the fork then takes it)
        self.holders: dict[int, int] = {}
        self.num_held = 0
        self.slab_of: dict[int, int] = {}  # model mode: request id -> its slab in `cache`

    def _slab(self, request: Request) -> int:
        return self.max_model_len

    def holds(self, request: Request) -> bool:
        return request.request_id in self.holders

    def admit(self, request: Request) -> bool:
        if self.num_held + request.num_seqs > self.num_slabs:
            return False
        self.holders[request.request_id] = request.num_seqs
        self.num_held += request.num_seqs
        if self.cache is not None:
            self.slab_of[request.request_id] = self.cache.add_sequence()
        return True

    def free(self, request: Request) -> None:
        self.num_held -= self.holders.pop(request.request_id)
        if self.cache is not None:
            self.cache.free_sequence(self.slab_of.pop(request.request_id))

    def fork(self, parent: Request, child: Request) -> None:
        if self.holders.get(parent.request_id, 0) < 2:
            raise RuntimeError(f"request {parent.request_id} holds no slab for its fork "
                               f"{child.request_id}")
        self.holders[parent.request_id] -= 1
        self.holders[child.request_id] = 1
        if self.cache is not None:  # a slab of its own, holding a copy of the parent's tokens
            self.slab_of[child.request_id] = self.cache.fork_sequence(
                self.slab_of[parent.request_id])

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_held * self.max_model_len


class GapRefusal(NamedTuple):
    """One admission refused for want of a gap although enough slots were free in total: the
    request, the slots it asked for, the free slots then (>= size), the gaps then as (start,
    length) in address order (each < size), and the memory then (`FirstFitSlabManager.draw`)."""

    request_id: int
    size: int
    free_tokens: int
    gaps: list[tuple[int, int]]
    picture: str


class FirstFitSlabManager(KVManager):
    """One run of `reserve(request)` adjacent slots per request, at the first gap big enough; a
    finished run becomes a gap, merged with free neighbours. Nothing moves (that would copy K/V).

    Attributes:
        runs, run_ends, run_owners: each run's start slot, end (one past) and request id, by start.
        num_refusals: admissions refused, each counted (5 steps waiting at the head count 5).
        num_gap_refusals: of those, the ones where the free slots added up were enough (external
            fragmentation); `gap_refused_requests` their ids, `free_at_gap_refusals` their free
            slots summed, `worst_gap_refusal` the one with the most free (a `GapRefusal`, or None).
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
    def num_free_tokens(self) -> int:  # wherever they are
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

    def holds(self, request: Request) -> bool:
        return request.request_id in self.holding

    def admit(self, request: Request) -> bool:
        size = self.reservation(request)
        start = first_fit(self.gaps(), size)
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
        """The memory as `width` characters: '#' all reserved, '.' all free, '+' partly both."""
        cells = [0] * width  # reserved slots per character
        per_cell = self.capacity_tokens / width
        for start, end in zip(self.runs, self.run_ends):
            for cell in range(int(start // per_cell), min(width, int(-(-end // per_cell)))):
                low, high = cell * per_cell, (cell + 1) * per_cell
                cells[cell] += max(0.0, min(end, high) - max(start, low))
        return "".join("#" if held >= per_cell - 1e-9 else "." if held == 0 else "+"
                       for held in cells)


class ExactBlocksManager(KVManager):
    """`FirstFitSlabManager`'s reservation in whole blocks, all taken at admission from an empty
    stage-4 `manager` (not one at a time, as paging does): only the placement differs."""

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
