"""One memory report for every stage: count bytes, never estimate them, and read the allocator.

Every KV and weight figure is the exact byte count of tensors (numel x element_size). Beside them,
the report reads what the device itself says, in the same shape on every stage: on CUDA the
caching allocator's `memory_allocated`, `memory_reserved` and `max_memory_allocated` and the
driver's `mem_get_info` (free / total); on the CPU the process's resident memory (RSS, which
includes Python, torch and every library, so only its changes mean something). A cache that
recorded `torch.cuda.memory_allocated` around allocating its tensors is cross-checked: the
allocator's delta must equal the tensor bytes, up to the allocator's rounding (`check_allocator`).
The vLLM paper's memory figures (Kwon et al., SOSP 2023, section 6) are read the same way, from the
allocator, which is why the course does too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Iterable, Protocol

import torch

from .device import default_device
from .sizing import format_bytes

__all__ = ["MemoryReport", "measure", "tensor_bytes", "device_name", "AccountedCache",
           "check_allocator", "resident_bytes"]

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


def resident_bytes() -> int | None:
    """This process's resident memory (RSS) in bytes: /proc on Linux, else the peak from
    `resource` (macOS gives bytes, other Unixes KiB); None where neither exists (Windows)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def check_allocator(delta_bytes: int, tensor_bytes_: int, num_tensors: int) -> None:
    """RuntimeError unless the allocator's growth while tensors were made (delta_bytes) covers
    their bytes, rounded up by at most the allocator's slack per tensor."""
    slack = num_tensors * _CUDA_SLACK_PER_TENSOR
    if not 0 <= delta_bytes - tensor_bytes_ <= slack:
        raise RuntimeError(f"the CUDA allocator saw {delta_bytes:,} B for the KV cache but its "
                           f"{num_tensors} tensors hold {tensor_bytes_:,} B (allowed rounding: "
                           f"0 to {slack:,} B)")


@dataclasses.dataclass
class MemoryReport:
    """A model's and its KV cache's bytes on a device, counted, beside what the device reports:
    on CUDA the allocator (allocated, reserved, peak, free and total; allocator_kv_bytes: the
    cache's own allocator delta), on the CPU the process's resident memory."""

    device: str
    weights_bytes: int
    kv_reserved_bytes: int
    kv_used_bytes: int
    # CUDA: torch.cuda's figures for the device
    allocated_bytes: int | None = None
    allocator_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    allocator_kv_bytes: int | None = None
    # CPU: the process's resident memory
    resident_bytes: int | None = None

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
        for name, value in (("allocated (CUDA)", self.allocated_bytes),
                            ("reserved by the allocator (CUDA)", self.allocator_reserved_bytes),
                            ("peak allocated (CUDA)", self.peak_allocated_bytes),
                            ("free on the device (CUDA)", self.free_bytes),
                            ("device total (CUDA)", self.total_bytes),
                            ("process resident memory (CPU)", self.resident_bytes)):
            if value is not None:
                rows.append((name, _exact(value)))
        return rows

    def __str__(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"{name:<{width}}  {value}" for name, value in self.rows())


def _exact(num_bytes: int) -> str:
    return f"{num_bytes:,} B ({format_bytes(num_bytes)})"


def measure(model: torch.nn.Module | None = None, cache: AccountedCache | None = None,
            device: str | torch.device | None = None) -> MemoryReport:
    """Weights (tied once) and a cache's bytes, and the device's own figures (`device` default:
    the model's, else the cache's, else the course's). RuntimeError (`check_allocator`): the cache
    recorded an allocator delta that disagrees with its tensor bytes."""
    if device is None:
        if model is not None:
            device = next(model.parameters()).device
        else:
            device = getattr(cache, "device", None) or default_device()
    device = torch.device(device)
    weights = tensor_bytes(model.parameters()) if model is not None else 0
    reserved = cache.reserved_bytes if cache is not None else 0
    used = cache.used_bytes if cache is not None else 0
    report = MemoryReport(device_name(device), weights, reserved, used)
    delta = cache.allocator_delta_bytes if cache is not None else None
    if delta is not None:
        # Compare with what the cache allocated, not what it reserved: a paged cache allocates
        # its whole pool up front and reserves blocks of it.
        check_allocator(delta, cache.allocated_bytes, cache.num_tensors)
        report.allocator_kv_bytes = delta
    if device.type == "cuda":
        report.allocated_bytes = torch.cuda.memory_allocated(device)
        report.allocator_reserved_bytes = torch.cuda.memory_reserved(device)
        report.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        report.free_bytes, report.total_bytes = torch.cuda.mem_get_info(device)
    else:
        report.resident_bytes = resident_bytes()
    return report
