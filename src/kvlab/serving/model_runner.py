"""Model mode's runner: one scheduled step through the real model and the real cache tensors.

The scheduler decides, this module executes (vLLM v1's model runner, cut to its core). A step:

1. copies the blocks the step's copy-on-write asked for (`SchedulerOutput.blocks_to_copy`);
2. runs one forward pass over every scheduled token, flat [num_tokens] in schedule order with
   their absolute positions (RoPE needs them): decode tokens and prefill chunks together;
3. samples a token for every request whose tokens are now all computed, from its last token's
   logits row: greedy, from its own random stream (`kvlab.sampling`), or its forced first token;
   a request whose prompt is now computed samples for its forks from the same row too.

Why one pass: its KV store (`PagedBatchStore`, or `SlabBatchStore` for slabs and the naive
strategy) writes every token's K/V in a layer before any token of that layer attends, so a block
is readable from the pass that writes it, whatever the batch order. The prefix cache relies on it
(a request admitted later in the step may hit a block cached when its slots were reserved); two
passes could read a block before it is written (tests/test_one_pass.py). vLLM v1's
`GPUModelRunner` does the same: `reshape_and_cache` writes the new K/V before attention reads.
"""

from __future__ import annotations

import time

import torch

from ..contiguous import ContiguousKVCache
from ..cpu_linear import pack_linear_weights
from ..paged.paged_cache import PagedKVCache
from ..sampling import next_token
from .cost_model import CostModel
from .request import Request, RequestState
from .reservation import ContiguousManager
from .scheduler import SchedulerOutput

__all__ = ["ModelRunner"]


class ModelRunner:
    """The real model over stage 4's `PagedKVCache`, whose `manager` the scheduler drives and
    whose attention backend (torch or the stage-5 Triton kernel) reads, or stage 2's
    `ContiguousKVCache`, whose slabs `slabs` (the scheduler's `ContiguousManager`) hands out. The
    clock: `cost_model`'s step time if given (repeatable), else the wall clock.
    `num_decode_tokens`, `num_prefill_tokens`: `_count`. ValueError: a contiguous cache without
    the manager built over it."""

    def __init__(self, model, cache, cost_model: CostModel | None = None,
                 slabs: ContiguousManager | None = None):
        self.model, self.cache, self.cost_model = model, cache, cost_model
        pack_linear_weights(model)  # oneDNN on a CPU, as vLLM's CPU backend (kvlab.cpu_linear)
        self.paged = isinstance(cache, PagedKVCache)
        if isinstance(cache, ContiguousKVCache) and (slabs is None or slabs.cache is not cache):
            raise ValueError("a contiguous cache runs with the ContiguousManager that hands out "
                             "its slabs (ModelRunner(..., slabs=ContiguousManager(..., cache)))")
        self.slabs = slabs
        self.generators: dict[int, torch.Generator] = {}  # request_id -> its random stream
        self.num_prefill_tokens = self.num_decode_tokens = 0

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> tuple[dict[int, int], float]:
        """Run one step. Returns (request_id -> sampled token, the step's seconds)."""
        started = time.perf_counter()
        modelled = self.cost_model.step_time_of(output.scheduled) if self.cost_model else None
        for source, destination in output.blocks_to_copy:
            self.cache.copy_block(source, destination)
        sampled: dict[int, int] = {}
        if output.scheduled:
            # A prefill chunk that leaves tokens for later needs no logits.
            sampling, last_rows, end = [], [], 0
            for request, num_new in output.scheduled:
                end += num_new  # the row after this request's last token
                self._count(request, num_new)
                if request.num_computed_tokens + num_new == request.num_tokens:
                    sampling.append(request)
                    last_rows.append(end - 1)
            logits = self._forward(output.scheduled, last_rows)
            for request, row in zip(sampling, logits):
                self._sample(request, row, sampled)
        elapsed = time.perf_counter() - started
        return sampled, (modelled if modelled is not None else elapsed)

    def _count(self, request: Request, num_new: int) -> None:
        """An output token fed back on top of the cache is decode; every other token run is prefill
        (prompt tokens, a lone last one too, and recomputed ones; prefix-cache hits are not run)."""
        if num_new == 1 and request.num_computed_tokens >= request.prompt_len:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_new

    def release(self, request: Request) -> None:
        """The request's memory was freed: finished (forget its stream) or preempted (keep it)."""
        if request.state is RequestState.FINISHED:
            self.generators.pop(request.request_id, None)

    def _sample(self, request: Request, logits: torch.Tensor, sampled: dict[int, int]) -> None:
        """The next token of `request` (and the first of each of its forks) from one logits row."""
        sampled[request.request_id] = self._next_token(request, logits)
        for child in request.forks:  # the scheduler forks them from `request` in `update`
            sampled[child.request_id] = self._next_token(child, logits)

    def _next_token(self, request: Request, logits: torch.Tensor) -> int:
        """Forced first token, else greedy, else a sample from the request's own stream."""
        params = request.sampling
        if request.num_output_tokens == 0 and params.first_token is not None:
            return params.first_token
        if params.temperature == 0:
            return int(logits.argmax())
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(params.stream_seed)
            self.generators[request.request_id] = generator
        return next_token(logits, params.temperature, generator)

    def _forward(self, scheduled: list[tuple[Request, int]], logits_rows: list[int]
                 ) -> torch.Tensor:
        """One pass over tokens computed .. computed + num_new - 1 of every scheduled request,
        flat in schedule order. Returns logits [len(logits_rows), vocab_size] of those rows."""
        token_ids, positions, query_lens, seq_lens = [], [], [], []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            token_ids += request.token_ids(start, start + num_new)
            positions += range(start, start + num_new)
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
        store = self._store([request for request, _ in scheduled], query_lens, seq_lens)
        device = self.model.device
        return self.model(torch.tensor(token_ids, device=device),
                          torch.tensor(positions, device=device), store,
                          logits_indices=torch.tensor(logits_rows, dtype=torch.long,
                                                      device=device))

    def _store(self, batch: list[Request], query_lens: list[int], seq_lens: list[int]):
        """Where the pass's K/V live (see `kvlab.model.KVStore`): request i's last query_lens[i]
        of seq_lens[i] tokens."""
        if self.paged:
            # The scheduler's manager reserved exactly these slots this step; the cache computes
            # the slot mapping from its tables, once for the pass.
            return self.cache.batch_store([request.request_id for request in batch], query_lens)
        slab_of = self.slabs.slab_of  # claimed at admission, a fork's at its fork
        return self.cache.batch_store([slab_of[r.request_id] for r in batch], query_lens, seq_lens)
