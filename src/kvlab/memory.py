"""One memory report for every stage: count bytes, never estimate them.

Every figure is the exact byte count of tensors (numel x element_size). On CUDA it is
cross-checked: the cache records `torch.cuda.memory_allocated` around allocating its tensors, and
`measure` checks that delta against the tensor bytes, up to the allocator's rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol

import torch

from .sizing import format_bytes

__all__ = ["MemoryReport", "measure", "tensor_bytes", "device_name", "AccountedCache"]

# torch's caching allocator rounds every request up to 512 B (c10 kMinBlockSize), and gives a large
# request a 2 MiB-rounded segment that it splits only when more than 1 MiB (kSmallSize) is left
# over, so memory_allocated can exceed a tensor's bytes by up to 1 MiB per tensor.
_CUDA_SLACK_PER_TENSOR = 2**20 + 512


class AccountedCache(Protocol):
    """What `measure` reads: reserved_bytes (held blocks, or every slab), used_bytes (tokens held x
    KV bytes per token), allocated_bytes (every tensor), allocator_delta_bytes (CUDA, else None)."""

    reserved_bytes: int
    used_bytes: int
    allocated_bytes: int
    num_tensors: int
    allocator_delta_bytes: int | None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Exact bytes of some tensors: sum of numel x element_size (shared storage counted per tensor)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def device_name(device: str | torch.device) -> str:
    """'cpu', or the CUDA card's name (e.g. 'NVIDIA H100 80GB HBM3')."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@dataclasses.dataclass
class MemoryReport:
    """A model's and its KV cache's bytes on a device (as `AccountedCache`; last two CUDA only)."""

    device: str
    weights_bytes: int
    kv_reserved_bytes: int
    kv_used_bytes: int
    peak_allocated_bytes: int | None = None
    allocator_kv_bytes: int | None = None

    @property
    def waste(self) -> float:
        """1 - used / reserved: reserved KV memory holding no token (0 if none reserved)."""
        if self.kv_reserved_bytes == 0:
            return 0.0
        return 1.0 - self.kv_used_bytes / self.kv_reserved_bytes

    def rows(self) -> list[tuple[str, str]]:
        rows = [("device", self.device),
                ("weights", _exact(self.weights_bytes)),
                ("KV reserved", _exact(self.kv_reserved_bytes)),
                ("KV used (holding tokens)", _exact(self.kv_used_bytes)),
                ("KV waste", f"{self.waste:.1%}")]
        if self.allocator_kv_bytes is not None:
            rows.append(("KV per CUDA allocator", _exact(self.allocator_kv_bytes)))
        if self.peak_allocated_bytes is not None:
            rows.append(("peak allocated (CUDA)", _exact(self.peak_allocated_bytes)))
        return rows

    def __str__(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"{name:<{width}}  {value}" for name, value in self.rows())


def _exact(num_bytes: int) -> str:
    return f"{num_bytes:,} B ({format_bytes(num_bytes)})"


def measure(model: torch.nn.Module | None = None, cache: AccountedCache | None = None,
            device: str | torch.device | None = None) -> MemoryReport:
    """Weights (tied once) and a cache's bytes on `device` (default the model's, else CPU);
    RuntimeError: on CUDA, the allocator's delta and the tensor bytes disagree past its rounding."""
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    device = torch.device(device)
    weights = tensor_bytes(model.parameters()) if model is not None else 0
    reserved = cache.reserved_bytes if cache is not None else 0
    used = cache.used_bytes if cache is not None else 0
    report = MemoryReport(device_name(device), weights, reserved, used)
    if device.type == "cuda":
        report.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        delta = cache.allocator_delta_bytes if cache is not None else None
        if delta is not None:
            report.allocator_kv_bytes = delta
            # Compare with what the cache allocated, not what it reserved: a paged cache
            # allocates its whole pool up front and reserves blocks of it.
            allocated = cache.allocated_bytes
            slack = cache.num_tensors * _CUDA_SLACK_PER_TENSOR
            if not 0 <= delta - allocated <= slack:
                raise RuntimeError(f"CUDA allocator saw {delta:,} B for the KV cache but its "
                                   f"tensors hold {allocated:,} B")
    return report
