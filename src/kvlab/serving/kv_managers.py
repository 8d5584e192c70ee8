"""Reserve-at-admission managers, answering the scheduler's verbs like the paged one.

The scheduler calls every KV strategy with vLLM v1's verbs (`kvlab.paged.KVCacheManager`:
`reject_reason`, `get_computed_blocks`, `allocate_slots`, `free`, `fork`, `take_copies`,
`num_reserved_tokens`, `capacity_tokens`, `usage()`). A manager that reserves all of a request's
memory when it admits it answers them simply: `allocate_slots` takes the reservation on the
request's first call (None if it does not fit now) and returns [] after, since the reservation was
sized for the whole request; nothing is ever computed already; preemption is `free`.

`ContiguousManager` is stage 2's reservation: a max_model_len slab per request. The exact-size
reservations of stage 4's fragmentation figures (`exact_reservation`) and the naive server
(`kvlab.oom_story.naive`) are the others. Token counts are the unit; bytes are tokens x KV bytes
per token.
"""

from __future__ import annotations

import abc
from typing import Sequence

from ..errors import KVCacheOutOfMemory
from ..paged.kv_cache_manager import too_long_reason
from .request import Request

__all__ = ["KVManager", "ContiguousManager"]


class KVManager(abc.ABC):
    """A manager that reserves a request's memory whole, at admission.

    Attributes:
        name: the strategy's name in tables ('contiguous', ...).
        max_model_len: longest request (prompt + max_output_tokens) the server accepts.
        capacity_tokens: token slots in the whole KV budget.
    """

    name: str
    max_model_len: int
    capacity_tokens: int
    has_prefix_cache = False
    # False for a design that holds one sequence per request (nothing to share between the n
    # completions of one prompt): requests with forks are then refused on arrival.
    supports_forks = True

    def reject_reason(self, request: Request) -> str | None:
        """Why this request can never be served, or None. Checked once, on arrival."""
        reason = too_long_reason(request, self.max_model_len)
        if reason is None and request.forks and not self.supports_forks:
            reason = (f"n = {request.num_seqs} completions: the {self.name} strategy holds one "
                      f"sequence per request (nothing to share between them)")
        return reason

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

    def holds(self, request: Request) -> bool:
        return request.request_id in self.holders

    def admit(self, request: Request) -> bool:
        if self.num_held + request.num_seqs > self.num_slabs:
            return False
        self.holders[request.request_id] = request.num_seqs
        self.num_held += request.num_seqs
        return True

    def free(self, request: Request) -> None:
        self.num_held -= self.holders.pop(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        if self.holders.get(parent.request_id, 0) < 2:
            raise RuntimeError(f"request {parent.request_id} holds no slab for its fork "
                               f"{child.request_id}")
        self.holders[parent.request_id] -= 1
        self.holders[child.request_id] = 1

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_held * self.max_model_len
