"""External fragmentation, drawn: contiguous reservations placed first fit in one memory.

A server that reserves each request's KV cache as one contiguous run of token slots fragments its
memory even when every reservation has exactly the right size: requests finish in a different order
than they started, and the free slots end up scattered in gaps too small for the next request. Fixed
size blocks (paging) remove that kind of waste, because any free block will do. This is the external
fragmentation of Kwon et al., *Efficient Memory Management for Large Language Model Serving with
PagedAttention* (SOSP 2023), section 3 and figure 3.

Notebook 04 draws it: a memory as a string, one character per token slot ('.' = free), `gaps_of`
to list its gaps, `first_fit` / `place` to fill it. Real traffic is measured by the one scheduler
with `kvlab.serving.reservation.FirstFitSlabManager`, against the same reservations in blocks.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["FREE", "gaps_of", "first_fit", "place"]

FREE = "."  # a free slot in a memory drawn as a string


def gaps_of(memory: str) -> list[tuple[int, int]]:
    """The free gaps of a memory drawn as a string, as (start slot, length) in address order."""
    out, start = [], None
    for index, slot in enumerate(memory + "#"):  # a sentinel closes the last gap
        if slot == FREE and start is None:
            start = index
        elif slot != FREE and start is not None:
            out.append((start, index - start))
            start = None
    return out


def first_fit(gaps: Iterable[tuple[int, int]], size: int) -> int | None:
    """Start slot of the first of `gaps` (as `gaps_of` lists them) with at least `size` (>= 1, else
    ValueError) slots, or None: the one first-fit search (`place`, `FirstFitSlabManager`)."""
    if size < 1:
        raise ValueError(f"size must be >= 1 slot, got {size}")
    for start, length in gaps:
        if length >= size:
            return start
    return None


def place(memory: str, name: str, size: int) -> str:
    """`memory` with `size` slots of the first big-enough gap filled with `name`. ValueError:
    `name` is not one character other than FREE, or no gap fits (the message gives the free slots
    in total, which may well be enough)."""
    if len(name) != 1 or name == FREE:
        raise ValueError(f"name must be one character other than {FREE!r}, got {name!r}")
    start = first_fit(gaps_of(memory), size)
    if start is None:
        raise ValueError(f"no gap of {size} free slots: {memory.count(FREE)} slots are free "
                         f"in total, in gaps too small")
    return memory[:start] + name * size + memory[start + size:]
