"""The naive strategy: no KV memory manager at all, one tensor per request, the allocator decides.

Before paged attention, a server kept each request's keys and values in contiguous memory of its
own, reserved for the most tokens the request could reach (the vLLM paper, Kwon et al., SOSP 2023,
section 3, describes this in the systems before it; Hugging Face's `StaticCache` is sized the
same way up front): here one tensor per request, allocated when it is admitted, sized for its
prompt plus its `max_output_tokens`, freed when it ends. Nothing counts memory, so the server
admits requests up to `max_num_seqs` and finds out it has run out when `torch.empty` raises
`torch.OutOfMemoryError` (the class `torch.cuda.OutOfMemoryError` names). The tensors have a
different size each, so the caching allocator splits freed blocks to serve smaller ones and the
free memory ends up in pieces: the paper's external fragmentation (see `.allocator`).
`kvlab.serving.reservation.FirstFitSlabManager` places the same reservations by first fit in an
address space it draws and counts; here the real allocator places them, and only its books tell.

What this server does when the allocator refuses (a choice, documented and tested):

* the failed allocation changes no state: anything allocated for the request is freed, and the
  request stays at the head of the waiting queue (the scheduler sees "no room now");
* the allocator's figures are recorded in an `OutOfMemoryReport`;
* the server's concurrency cap drops to the number of requests running at that moment (a batch
  size found by trial, the only way a server without a memory manager can find one), so it does
  not hammer the allocator every step; the request is admitted once one of them finishes.

No running request is touched: one request that does not fit never takes down the others. A
request that could not fit even alone is rejected on arrival (`reject_reason`), with the bytes.

A forward pass needs memory too (activations, logits). With KV tensors allocated wherever the
allocator likes, the next forward pass could be the allocation that fails, in the middle of a
batch. So after allocating a request's KV the manager also asks for the forward pass's workspace
(its peak, measured by a profiling pass at start-up, as vLLM measures it) and gives it straight
back: if that fails, the request is not admitted. That is the only guard; nothing is reserved.

`NaiveExecutor` runs the model over these tensors (the same model, attention and sampling as every
strategy: `ModelRunner`'s one forward pass per step, each request's K/V in its own tensor, through
the contiguous cache's `SlabBatchStore`, `naive_store`).
"""

from __future__ import annotations

import torch

from kvlab.contiguous import SlabBatchStore
from kvlab.errors import KVCacheOutOfMemory
from kvlab.serving.reservation import KVManager
from kvlab.serving.model_runner import ModelRunner
from kvlab.serving.request import Request
from kvlab.sizing import format_bytes, kv_bytes_per_token
from .allocator import AllocatorFigures, ByteLimit, OutOfMemoryReport, cuda_figures

__all__ = ["NaiveManager", "NaiveExecutor", "naive_store"]


class NaiveManager(KVManager):
    """One K/V tensor per request, [num_hidden_layers, 2, prompt + max_output_tokens,
    num_key_value_heads, head_dim] in `dtype`, taken whole at admission.

    Args:
        config: the model's `LlamaConfig`.
        dtype / device: of the KV tensors.
        max_model_len: longest request accepted.
        capacity_bytes: memory the KV tensors could ever have (the process limit - weights -
            workspace): a request larger than this alone is rejected on arrival; also the
            denominator of `usage()`.
        workspace_bytes: the forward pass's peak activation bytes, asked for (and returned) after
            each KV allocation (0: no check).
        allocator: None for torch's own allocator on `device`; a `ByteLimit` to emulate a
            limited device on the CPU.
        limit_bytes: the process limit set on the CUDA device (for the figures), or None.

    Attributes:
        reports: one `OutOfMemoryReport` per refused allocation, in order.
        max_running: the concurrency cap learned from the last out-of-memory error (None: none yet).
        peak_running: most requests holding KV tensors at once.

    Raises:
        ValueError: capacity_bytes < 1, workspace_bytes < 0 or max_model_len < 1.
    """

    name = "naive"

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str, max_model_len: int,
                 capacity_bytes: int, workspace_bytes: int = 0, allocator: ByteLimit | None = None,
                 limit_bytes: int | None = None):
        if capacity_bytes < 1 or workspace_bytes < 0 or max_model_len < 1:
            raise ValueError(f"need capacity_bytes >= 1 ({capacity_bytes:,}), workspace_bytes >= 0 "
                             f"({workspace_bytes:,}) and max_model_len >= 1 ({max_model_len})")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.workspace_bytes = workspace_bytes
        self.allocator, self.limit_bytes = allocator, limit_bytes
        self.bytes_per_token = kv_bytes_per_token(config, dtype)
        self.capacity_bytes = capacity_bytes
        # the reservation of `KVManager`: exact_size, prompt + max_output_tokens
        super().__init__(max(1, capacity_bytes // self.bytes_per_token), max_model_len)
        self.kv: dict[int, torch.Tensor] = {}      # request_id -> its K/V tensor
        self.reports: list[OutOfMemoryReport] = []
        self.max_running: int | None = None
        self.peak_running = 0

    # ---- the allocator: torch's, or an emulated limit on the CPU --------------------------------

    def new_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Ask the allocator for a tensor; raises torch.OutOfMemoryError when it refuses."""
        if self.allocator is not None:
            return self.allocator.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def drop_tensor(self, tensor: torch.Tensor) -> None:
        """Give a tensor back (torch frees it when the last reference goes)."""
        if self.allocator is not None:
            self.allocator.release(tensor)

    def figures(self) -> AllocatorFigures:
        if self.allocator is not None:
            return self.allocator.figures()
        return cuda_figures(self.device, self.limit_bytes)

    # ---- KVManager ------------------------------------------------------------------------------

    def request_bytes(self, request: Request) -> int:
        """Bytes of a request's K/V tensor: its reservation x KV bytes per token."""
        return self.reservation(request) * self.bytes_per_token

    def too_big_reason(self, request: Request) -> str | None:
        if self.request_bytes(request) > self.capacity_bytes:
            return (f"{self.reservation(request):,} tokens x {format_bytes(self.bytes_per_token)} "
                    f"= {format_bytes(self.request_bytes(request))} > "
                    f"{format_bytes(self.capacity_bytes)} of KV memory even with nothing else "
                    f"running")
        return None

    def holds(self, request: Request) -> bool:
        return request.request_id in self.kv

    def admit(self, request: Request) -> bool:
        if self.max_running is not None and len(self.kv) >= self.max_running:
            return False  # waits for a running request to finish
        shape = (self.config.num_hidden_layers, 2, self.reservation(request),
                 self.config.num_key_value_heads, self.config.head_dim)
        try:
            tensor = self.new_tensor(shape, self.dtype)
        except torch.OutOfMemoryError:
            self._out_of_memory(request, "KV cache", self.request_bytes(request))
            return False
        if self.workspace_bytes:
            try:  # can the next forward pass still get its activations? (module docstring)
                self.drop_tensor(self.new_tensor((self.workspace_bytes,), torch.uint8))
            except torch.OutOfMemoryError:
                self.drop_tensor(tensor)
                del tensor
                self._out_of_memory(request, "forward-pass workspace after its KV cache",
                                    self.workspace_bytes)
                return False
        self.kv[request.request_id] = tensor
        self.peak_running = max(self.peak_running, len(self.kv))
        return True

    def _out_of_memory(self, request: Request, what: str, num_bytes: int) -> None:
        """Record the refusal and lower the concurrency cap; the request keeps waiting.

        Raises:
            KVCacheOutOfMemory: nothing else holds KV memory, so waiting cannot help (the limit
                is too small for the model; `reject_reason` lets through only requests that fit
                `capacity_bytes`).
        """
        running = len(self.kv)
        if running == 0:
            action = "Nothing else holds KV memory: the server cannot run at this limit."
        else:
            self.max_running = running if self.max_running is None else min(self.max_running,
                                                                             running)
            action = (f"It waits at the head of the queue; the server now admits at most "
                      f"{self.max_running} requests at once.")
        report = OutOfMemoryReport(request.request_id, request.prompt_len,
                                   request.max_output_tokens, what, num_bytes, running,
                                   self.figures(), action)
        self.reports.append(report)
        if running == 0:
            raise KVCacheOutOfMemory(report.message())

    def free(self, request: Request) -> None:
        self.drop_tensor(self.kv.pop(request.request_id))

    @property
    def num_reserved_tokens(self) -> int:
        return sum(tensor.shape[2] for tensor in self.kv.values())

    def release_all(self) -> None:
        """Drop every tensor (after a run that was stopped part-way)."""
        for request_id in list(self.kv):
            self.drop_tensor(self.kv.pop(request_id))


class NaiveExecutor(ModelRunner):
    """The model over `NaiveManager`'s tensors: `ModelRunner` (same step, same pass, same
    sampling) whose KV store is each request's own tensor (`naive_store`).

    Args:
        model: the decoder (`kvlab.model.LlamaForCausalLM`).
        kv: the `NaiveManager` the scheduler drives (it frees the tensors, at finish or preemption).
        cost_model: if given, its step time is the clock; else the wall clock.
    """

    def __init__(self, model, kv: NaiveManager, cost_model=None):
        super().__init__(model, kv, cost_model)
        self.kv = kv

    def _store(self, batch: list[Request], query_lens: list[int],
               seq_lens: list[int]) -> SlabBatchStore:
        return naive_store([self.kv.kv[request.request_id] for request in batch], query_lens,
                           seq_lens)


def naive_store(tensors: list[torch.Tensor], query_lens: list[int],
                seq_lens: list[int]) -> SlabBatchStore:
    """The KV store of one forward pass over the newest tokens of several requests, tensor i
    ([num_hidden_layers, 2, max tokens, num_key_value_heads, head_dim], K then V) request i's;
    query_lens and seq_lens as `SlabBatchStore`."""
    return SlabBatchStore([tensor[:, 0] for tensor in tensors],
                          [tensor[:, 1] for tensor in tensors], query_lens, seq_lens)
