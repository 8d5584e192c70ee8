"""What the memory allocator says when a KV allocation fails: the figures, and the arithmetic.

The one place the demonstration reads the allocator's books. A server with no KV memory manager
(stage 7's naive strategy) asks PyTorch for one tensor per
request, so the allocator is the only thing that decides how many requests run. PyTorch's CUDA
caching allocator (c10/cuda/CUDACachingAllocator) keeps freed blocks for reuse instead of returning
them to the driver, and splits a cached block to serve a smaller request. Its books, read here from
`torch.cuda.memory_stats()` and `torch.cuda.mem_get_info()`:

* allocated: bytes of live tensors;
* reserved: bytes of the segments it holds from the driver (allocated + cached);
* reserved but unallocated = reserved - allocated. When an allocation cannot be served, the
  allocator first returns every *whole* cached segment to the driver and retries; what is still
  reserved but unallocated after that lies in segments that also hold live tensors: the free
  remainders of split blocks (`inactive_split_bytes`). That is external fragmentation: free memory
  in pieces, none large enough. `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` exists for it
  (segments that grow in place, so freed pages can be mapped where they are needed);
* the largest free block inside the reserved segments (from `torch.cuda.memory_snapshot()`), and
  the room left for a new segment: min(free on the device, the process limit - reserved).

* over a run (since `torch.cuda.reset_peak_memory_stats`): the peaks of reserved memory and of
  split-block bytes, and how often it retried after freeing cached blocks (`run_peaks`).

An allocation of n bytes succeeds if a cached free block holds n, or a new segment of n fits; so
the failure reads "n B > the most it could hand out". `OutOfMemoryReport` writes that sentence.

On a CPU there is no caching allocator: `ByteLimit` stands in for one in tests and in the GPU
tour's dry run, counting live tensor bytes against a limit and raising `torch.OutOfMemoryError`
past it. Its figures have no fragmentation (reserved = allocated) and say they are emulated.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.sizing import format_bytes

__all__ = ["AllocatorFigures", "OutOfMemoryReport", "ByteLimit", "cuda_figures", "run_peaks"]


@dataclasses.dataclass(frozen=True)
class AllocatorFigures:
    """The allocator's books at one moment, all in bytes.

    Attributes:
        source: 'torch.cuda caching allocator on <card>', or 'emulated on CPU (ByteLimit)'.
        allocated_bytes: live tensors.
        reserved_bytes: segments held from the driver (allocated + cached).
        inactive_split_bytes: free remainders of split blocks (memory_stats' figure; 0 on CPU).
        largest_free_block_bytes: largest free block inside the reserved segments.
        free_bytes / total_bytes: the device's free and total memory (cudaMemGetInfo).
        limit_bytes: what this process may reserve (set_per_process_memory_fraction x total), or
            None when no limit was set.
        num_ooms: out-of-memory errors the allocator has raised so far (memory_stats 'num_ooms').
    """

    source: str
    allocated_bytes: int
    reserved_bytes: int
    inactive_split_bytes: int
    largest_free_block_bytes: int
    free_bytes: int
    total_bytes: int
    limit_bytes: int | None = None
    num_ooms: int = 0

    @property
    def reserved_unallocated_bytes(self) -> int:
        """reserved - allocated: memory the allocator holds but no tensor uses."""
        return self.reserved_bytes - self.allocated_bytes

    @property
    def new_segment_room_bytes(self) -> int:
        """The largest new segment the allocator may still ask the driver for."""
        room = self.free_bytes
        if self.limit_bytes is not None:
            room = min(room, self.limit_bytes - self.reserved_bytes)
        return max(0, room)

    @property
    def most_servable_bytes(self) -> int:
        """The largest single allocation that could succeed now (a cached block or a new one)."""
        return max(self.largest_free_block_bytes, self.new_segment_room_bytes)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self),
                "reserved_unallocated_bytes": self.reserved_unallocated_bytes,
                "new_segment_room_bytes": self.new_segment_room_bytes,
                "most_servable_bytes": self.most_servable_bytes}

    def describe(self) -> str:
        """Multi-line summary, exact bytes with binary units."""
        limit = (f"; process limit {_b(self.limit_bytes)}" if self.limit_bytes is not None
                 else "")
        return "\n".join([
            f"{self.source}:",
            f"  allocated {_b(self.allocated_bytes)}, reserved {_b(self.reserved_bytes)}",
            f"  reserved but unallocated {_b(self.reserved_unallocated_bytes)}, of which in split "
            f"blocks (inactive_split_bytes, fragmentation) {_b(self.inactive_split_bytes)}; "
            f"largest free block {_b(self.largest_free_block_bytes)}",
            f"  device free {_b(self.free_bytes)} of {_b(self.total_bytes)}{limit}"])


def _b(num_bytes: int) -> str:
    return f"{num_bytes:,} B ({format_bytes(num_bytes)})"


def cuda_figures(device: torch.device | str = "cuda", limit_bytes: int | None = None
                 ) -> AllocatorFigures:
    """The CUDA caching allocator's figures now (see the module docstring for each).

    Args:
        device: a CUDA device.
        limit_bytes: the process limit the caller set (torch does not report it back), or None.

    Raises:
        RuntimeError: no CUDA device (torch's own error).
    """
    device = torch.device(device)
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    largest = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") not in (None, device.index or 0):
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                largest = max(largest, int(block["size"]))
    return AllocatorFigures(
        source=f"torch.cuda caching allocator on {torch.cuda.get_device_name(device)}",
        allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
        reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
        largest_free_block_bytes=largest, free_bytes=int(free), total_bytes=int(total),
        limit_bytes=limit_bytes, num_ooms=int(stats.get("num_ooms", 0)))


_PEAK_KEYS = {"reserved_bytes_peak": "reserved_bytes.all.peak",
              "inactive_split_bytes_peak": "inactive_split_bytes.all.peak",
              "num_alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms"}


def run_peaks(device: torch.device) -> dict:
    """The caching allocator's peaks since the last reset (`torch.cuda.memory_stats`), in bytes and
    counts: how far reserved memory and its split free remainders grew during a run."""
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in _PEAK_KEYS.items()}


class ByteLimit:
    """A stand-in for a GPU allocator on the CPU: live bytes against a fixed limit.

    `empty(shape, dtype)` returns a real CPU tensor, or raises `torch.OutOfMemoryError` (the class
    `torch.cuda.OutOfMemoryError` names) when live + its bytes would pass `limit_bytes`;
    `release(tensor)` gives its bytes back. There is no cache and no splitting, so it shows the
    out-of-memory story without fragmentation; its figures say they are emulated.

    Args:
        limit_bytes: bytes the "device" holds (> 0).
        baseline_bytes: bytes already in use that never come back (e.g. the weights).

    Raises:
        ValueError: limit_bytes <= 0 or baseline_bytes outside [0, limit_bytes].
    """

    def __init__(self, limit_bytes: int, baseline_bytes: int = 0):
        if limit_bytes <= 0 or not 0 <= baseline_bytes <= limit_bytes:
            raise ValueError(f"need 0 <= baseline_bytes ({baseline_bytes:,}) <= limit_bytes "
                             f"({limit_bytes:,}) and a positive limit")
        self.limit_bytes, self.live_bytes = limit_bytes, baseline_bytes
        self.num_ooms = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new CPU tensor, if the limit allows it (nothing changes when it does not)."""
        size = dtype.itemsize
        for dim in shape:
            size *= dim
        if self.live_bytes + size > self.limit_bytes:
            self.num_ooms += 1
            raise torch.OutOfMemoryError(
                f"ByteLimit: tried to allocate {format_bytes(size)}; "
                f"{format_bytes(self.live_bytes)} in use of a {format_bytes(self.limit_bytes)} limit")
        tensor = torch.empty(shape, dtype=dtype)
        self.live_bytes += size
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        self.live_bytes -= tensor.numel() * tensor.element_size()

    def figures(self) -> AllocatorFigures:
        free = self.limit_bytes - self.live_bytes
        return AllocatorFigures("emulated on CPU (ByteLimit: no caching allocator, so no "
                                "fragmentation)", self.live_bytes, self.live_bytes, 0, 0, free,
                                self.limit_bytes, self.limit_bytes, self.num_ooms)


@dataclasses.dataclass(frozen=True)
class OutOfMemoryReport:
    """One allocation the allocator refused, with the figures right after it failed.

    Attributes:
        request_id / prompt_len / max_output_tokens: the request that did not fit.
        what: what was being allocated ('KV cache', 'forward-pass workspace').
        requested_bytes: bytes of the failed allocation.
        num_running: requests holding KV memory at that moment (the concurrency the allocator
            allowed).
        figures: `AllocatorFigures` read after the failure.
        action: what the server did about it (one sentence).
    """

    request_id: int
    prompt_len: int
    max_output_tokens: int
    what: str
    requested_bytes: int
    num_running: int
    figures: AllocatorFigures
    action: str

    def message(self) -> str:
        """The course's error style: what was asked, '>', what there was, in bytes."""
        f = self.figures
        tokens = self.prompt_len + self.max_output_tokens
        return (f"request {self.request_id}: {self.what} for {self.prompt_len:,} prompt + "
                f"{self.max_output_tokens:,} output = {tokens:,} tokens = "
                f"{_b(self.requested_bytes)} > {_b(f.most_servable_bytes)}, the most the "
                f"allocator could hand out (largest free block in its reserved segments "
                f"{format_bytes(f.largest_free_block_bytes)}, room for a new segment "
                f"{format_bytes(f.new_segment_room_bytes)}), with {self.num_running} requests "
                f"running; {format_bytes(f.reserved_unallocated_bytes)} reserved but unallocated, "
                f"{format_bytes(f.inactive_split_bytes)} of it in split blocks. {self.action}")

    def as_dict(self) -> dict:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "figures"}
        return {**fields, "figures": self.figures.as_dict(), "message": self.message()}
