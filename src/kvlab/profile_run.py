"""vLLM's profile run: how much memory a forward pass needs on top of the weights and the KV cache.

A server shares its device between three things: the weights, the KV cache's block pool, and the
activations of the step it is running (hidden states, projections, attention scores, logits). The
first two are allocated once, at start-up; activations come and go inside every step, and a step
of `max_num_batched_tokens` tokens (a full prefill chunk) needs the most. So before vLLM sizes its
pool it runs one forward pass of that many dummy tokens, reads the allocator's peak, and keeps that
much free as headroom (vLLM v1's `Worker.determine_available_memory`; the pool gets the rest:
`kvlab.paged.num_blocks_for_budget`). Without the headroom the pool would take the activations'
memory, and the first long prefill would run out of memory mid-serving.

kvlab's profile run goes through the model's reference attention (`NoCache`), which holds the
scores [heads, tokens, tokens] in float32; a serving step of as many tokens prefills through SDPA
over its blocks instead, which holds less at the lengths the course serves. vLLM's profile run
skips attention altogether: no KV cache exists yet, and flash attention needs little memory.

What is measured, by device:

* CUDA: the caching allocator's own peak, `torch.cuda.max_memory_allocated` after
  `reset_peak_memory_stats`, minus what was allocated when the block began. Everything the block
  allocates through PyTorch counts, kernel workspaces and the allocator's rounding included.
* CPU: PyTorch's CPU allocator keeps no peak, so the tensors are counted. A dispatch mode sees
  every ATen operation the block runs; each tensor an operation returns in a new storage (not a
  view of, or a write into, one that existed) counts with its storage's bytes from that moment
  until the storage is freed, and the peak of their sum is reported. Not counted: scratch memory
  inside one kernel (e.g. a matmul's workspace), the allocator's rounding, and memory outside
  PyTorch. The sum is exact for what it counts and the same on every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .checks import check_int
from .device import resolve_device

__all__ = ["PeakMemory", "track_peak", "activation_peak"]


@dataclasses.dataclass
class PeakMemory:
    """What `track_peak` measured: `bytes` at the peak (set when the block ends), on `device`,
    by `method` ("CUDA allocator peak" or "tensors counted")."""

    device: str
    method: str
    bytes: int = 0


def _storage_ref(value) -> StorageWeakRef | None:
    """A weak reference to a tensor's storage; None for a non-tensor or a tensor without one (an
    opaque tensor, such as the oneDNN-packed weights of `kvlab.cpu_linear`: made at load time)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except NotImplementedError:
        return None


class _TensorCounter(TorchDispatchMode):
    """The CPU's count: bytes of the live storages that operations created, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage id -> (weak ref, bytes)
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {ref.cdata for ref in map(_storage_ref, tree_leaves((args, kwargs)))
                  if ref is not None}
        out = func(*args, **kwargs)
        # Storages freed since the last operation leave the count first. A weak reference keeps
        # a freed storage's id from being reused while we hold it, so ids cannot collide.
        for key in [key for key, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for tensor in tree_leaves(out):
            ref = _storage_ref(tensor)
            if ref is None or ref.cdata in inputs or ref.cdata in self.live:
                continue  # a view of, or a write into, memory that was there already
            num_bytes = tensor.untyped_storage().nbytes()
            self.live[ref.cdata] = (ref, num_bytes)
            self.current += num_bytes
        self.peak = max(self.peak, self.current)
        return out


@contextlib.contextmanager
def track_peak(device: str | torch.device | None = None) -> Iterator[PeakMemory]:
    """Peak bytes the block allocates on `device` (default: the course's) above what was there
    when it began: `with track_peak(env.device) as peak: ...`, then `peak.bytes`. On CUDA the
    allocator's peak (this resets its peak statistics); on the CPU counted tensors (module
    docstring: what is counted)."""
    device = resolve_device(device)
    if device.type == "cuda":
        result = PeakMemory(str(device), "CUDA allocator peak")
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - start
        return
    result = PeakMemory(str(device), "tensors counted")
    counter = _TensorCounter()
    with counter:
        yield result
    result.bytes = counter.peak


@torch.inference_mode()
def activation_peak(model, num_tokens: int) -> PeakMemory:
    """The profile run: one forward pass of `num_tokens` dummy tokens (positions 0 ..
    num_tokens - 1, no KV cache, logits of the last row only, as a server samples one row per
    sequence) on the model's device; the peak bytes it allocated. ValueError: num_tokens < 1 or
    above the model's max_position_embeddings."""
    check_int("num_tokens", num_tokens, 1, model.config.max_position_embeddings)
    device = model.device
    token_ids = torch.arange(num_tokens, device=device) % model.config.vocab_size
    last_row = torch.tensor([num_tokens - 1], device=device)
    with track_peak(device) as peak:
        model(token_ids, logits_indices=last_row)
    return peak
