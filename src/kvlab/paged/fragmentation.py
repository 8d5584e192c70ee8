"""External fragmentation, measured: contiguous reservations versus blocks in one memory.

A server that reserves each request's KV cache as one contiguous run of token slots fragments its
memory even when every reservation has exactly the right size: requests finish in a different order
than they started, and the free slots end up scattered in gaps too small for the next request. Fixed
size blocks (paging) remove that kind of waste, because any free block will do. This is the external
fragmentation of Kwon et al., *Efficient Memory Management for Large Language Model Serving with
PagedAttention* (SOSP 2023), section 3 and figure 3.

Notebook 04 uses two small tools from here:

* `first_fit` / `place`: a memory drawn as a string, one character per token slot ('.' = free),
  filled first-fit, so a learner can see the gaps;
* `serve`: a toy first-come-first-served scheduler that replays requests through one memory with
  three reservation designs and counts the steps at which a request waited *although enough slots
  were free in total*. It never preempts and never moves a reservation. Stage 7's scheduler, which
  runs every cache strategy on real traffic over time, is the course's real one; `serve` stays only
  as the smallest program that shows external fragmentation.

A request holds its reservation for `kvlab.lifetime.decode_steps(request)` steps (its prefill
included), the course's one definition of a request's lifetime.
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, Sequence

from ..lifetime import RequestSizes, decode_steps
from .block_table import cdiv

__all__ = ["FREE", "ServeResult", "first_fit", "place", "serve"]

FREE = "."  # a free slot in a memory drawn as a string


def first_fit(memory: str, size: int) -> int | None:
    """Index of the first run of `size` free slots ('.') in `memory`, or None when there is none.

    Args:
        memory: one character per token slot; FREE ('.') marks a free one.
        size: slots wanted, >= 1.

    Raises:
        ValueError: size < 1.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1 slot, got {size}")
    run = 0
    for index, slot in enumerate(memory):
        run = run + 1 if slot == FREE else 0
        if run == size:
            return index - size + 1
    return None


def place(memory: str, name: str, size: int) -> str:
    """`memory` with `size` slots of the first big-enough gap filled with `name` (one character).

    Raises:
        ValueError: `name` is not one character other than FREE, or no gap of `size` free slots
            exists (the message gives the free slots in total, which may well be enough).
    """
    if len(name) != 1 or name == FREE:
        raise ValueError(f"name must be one character other than {FREE!r}, got {name!r}")
    start = first_fit(memory, size)
    if start is None:
        raise ValueError(f"no gap of {size} free slots: {memory.count(FREE)} slots are free "
                         f"in total, in gaps too small")
    return memory[:start] + name * size + memory[start + size:]


class ServeResult(NamedTuple):
    """What `serve` measured.

    Attributes:
        steps: scheduler steps until every request finished.
        mean_in_flight: requests holding a reservation, averaged over the steps.
        waits_caused_by_gaps: steps at which the request at the head of the queue waited although
            the free slots, added up, would have held it (external fragmentation). Always 0 for
            blocks.
    """

    steps: int
    mean_in_flight: float
    waits_caused_by_gaps: int


def _first_gap(running: list[tuple[int, int, int]], size: int, memory_slots: int) -> int | None:
    """Start of the first gap of `size` free slots between the running slabs, or None.

    `running` holds (finish step, start slot, length) for each contiguous reservation.
    """
    end = 0
    for _, start, length in sorted(running, key=lambda slab: slab[1]):
        if start - end >= size:
            return end
        end = start + length
    return end if memory_slots - end >= size else None


def serve(requests: Sequence[RequestSizes], memory_slots: int,
          reserve: Callable[[RequestSizes], int], block_size: int | None = None) -> ServeResult:
    """Serve `requests` first come, first served from one memory; count what fragmentation costs.

    At every step, finished requests give their reservation back, then requests are admitted in
    order while their reservation fits; the head of the queue waits otherwise (no overtaking). A
    request keeps its reservation for `decode_steps(request)` steps.

    Args:
        requests: anything with `prompt_len` and `output_len` (tokens), e.g. `workload.Request`.
        memory_slots: token slots in the memory (>= 1).
        reserve: tokens to reserve for a request, e.g. `lambda r: max_model_len` (naive slabs) or
            `lambda r: r.total_len` (exact sizes, known in advance).
        block_size: None for contiguous reservations placed first-fit; else the reservation is
            rounded up to whole blocks of `block_size` tokens, and any free blocks will do.

    Returns:
        ServeResult(steps, mean_in_flight, waits_caused_by_gaps).

    Raises:
        ValueError: memory_slots < 1, block_size < 1, an empty request list, or a reservation that
            is below 1 token or larger than the whole memory (it could never be admitted).
    """
    if memory_slots < 1:
        raise ValueError(f"memory_slots must be >= 1, got {memory_slots}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1 or None, got {block_size}")
    if not requests:
        raise ValueError("no requests to serve")
    # Reservation in the memory's unit: slots for slabs, blocks for paging.
    capacity = memory_slots // block_size if block_size else memory_slots
    sizes = []
    for index, request in enumerate(requests):
        tokens = reserve(request)
        size = cdiv(tokens, block_size) if block_size else tokens
        if not 1 <= size <= capacity:
            unit = f"blocks of {block_size}" if block_size else "slots"
            raise ValueError(f"request {index} reserves {tokens} tokens = {size} {unit}; the "
                             f"memory holds 1 .. {capacity}")
        sizes.append(size)

    waiting = collections.deque(zip(requests, sizes))
    running: list[tuple[int, int, int]] = []  # (finish step, start slot or -1 for blocks, size)
    free = capacity
    step = in_flight = waits_caused_by_gaps = 0
    while waiting or running:
        for finished in [slab for slab in running if slab[0] == step]:
            running.remove(finished)
            free += finished[2]
        while waiting:
            request, size = waiting[0]
            if block_size:  # blocks: any free ones will do
                if size > free:
                    break
                start = -1
            else:           # slabs: the first gap that is big enough
                start = _first_gap(running, size, memory_slots)
                if start is None:
                    waits_caused_by_gaps += free >= size
                    break
            waiting.popleft()
            free -= size
            running.append((step + decode_steps(request), start, size))
        in_flight += len(running)
        step += 1
    return ServeResult(step, in_flight / step, waits_caused_by_gaps)
