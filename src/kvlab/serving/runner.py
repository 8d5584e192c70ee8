"""The serving loop, and the two ways to execute a step: the real model, or a cost model.

`serve` is the whole server in one loop (vLLM v1's engine core, cut to its core):

    while requests are pending or unfinished:
        queue every request that has arrived by now (reject the ones that can never fit)
        output  = scheduler.schedule()          # decides: who runs, how many tokens, who is preempted
        sampled = executor.execute(output)      # executes: a forward pass, or the cost model's time
        now    += the step's time
        scheduler.update(output, sampled, now)  # records: new tokens, finished requests freed

The scheduler and the KV managers are the same in both modes; only the executor differs:

* `ModelExecutor` (model mode) runs the real model, with K/V written to and read from the real
  cache tensors: stage 2's `ContiguousKVCache` (one slab per request) or stage 4's `PagedKVCache`
  (slot mapping through the block tables the scheduler's `PagedManager` fills). Decode tokens of
  the paged cache go in one batched forward pass; prefill chunks run one request at a time.
  Greedy sampling. The step time is the wall clock, or a cost model's (so runs are repeatable).
* `SimulatedExecutor` (simulation mode) runs nothing: the cost model (`cost_model.CostModel`) says
  how long the step would take on a named card, so a 19,366-request trace replays in seconds.
"""

from __future__ import annotations

import collections
import time
from typing import Protocol, Sequence

import torch

from ..attention import grouped_attention
from ..contiguous import ContiguousKVCache
from ..paged.block_table import cdiv
from ..paged.paged_cache import DecodeStore, PagedKVCache, PrefillStore
from .cost_model import CostModel
from ..prefix.manager import PrefixCachingKVCacheManager
from .kv_managers import ContiguousManager, KVManager, PagedManager, SlotlessKVCacheManager
from .metrics import ServeResult, StepSeries, summarize
from .prefix_manager import PrefixManager
from .request import Request
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Executor", "SimulatedExecutor", "ModelExecutor", "serve", "STRATEGIES",
           "simulated_manager", "model_strategy"]

STRATEGIES = ("contiguous", "paged", "prefix")


class Executor(Protocol):
    """Runs one scheduled step."""

    def execute(self, output: SchedulerOutput) -> tuple[dict[int, int] | None, float]:
        """Returns (request_id -> sampled token, or None in simulation; the step's seconds)."""
        ...

    def release(self, request: Request) -> None:
        """The request's memory was freed (finished or preempted)."""
        ...


class SimulatedExecutor:
    """No tensors: the step takes the cost model's time; no token ids are produced."""

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model

    def execute(self, output: SchedulerOutput) -> tuple[None, float]:
        return None, self.cost_model.step_time_of(output.scheduled)

    def release(self, request: Request) -> None:
        pass


class ModelExecutor:
    """The real model over a real cache; greedy next tokens.

    Args:
        model: the decoder.
        cache: a `ContiguousKVCache` (slabs handed out per request here) or a `PagedKVCache` whose
            `manager` is the one the scheduler's `PagedManager` drives.
        cost_model: if given, its step time is the clock (repeatable); else the wall clock.
    """

    def __init__(self, model, cache, cost_model: CostModel | None = None):
        self.model, self.cache, self.cost_model = model, cache, cost_model
        self.paged = isinstance(cache, PagedKVCache)
        self.slab_of: dict[int, int] = {}  # contiguous only: request_id -> slab

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> tuple[dict[int, int], float]:
        started = time.perf_counter()
        modelled = self.cost_model.step_time_of(output.scheduled) if self.cost_model else None
        sampled: dict[int, int] = {}
        decodes = [r for r, n in output.scheduled if n == 1 and r.num_computed_tokens > 0]
        if decodes:
            self._decode(decodes, sampled)
        for request, num_new in output.scheduled:
            if request.request_id in sampled:
                continue  # decoded in the batch above
            logits = self._forward_one(request, num_new)
            if request.num_computed_tokens + num_new == request.num_tokens:
                sampled[request.request_id] = int(logits[-1].argmax())
        elapsed = time.perf_counter() - started
        return sampled, (modelled if modelled is not None else elapsed)

    def release(self, request: Request) -> None:
        slab = self.slab_of.pop(request.request_id, None)
        if slab is not None:
            self.cache.free_sequence(slab)

    def _forward_one(self, request: Request, num_new: int) -> torch.Tensor:
        """Tokens computed .. computed + num_new - 1 of one request, at their absolute positions."""
        device = self.model.device
        start = request.num_computed_tokens
        ids = torch.tensor(request.token_ids(start, start + num_new), device=device)
        positions = torch.arange(start, start + num_new, device=device)
        if self.paged:
            blocks = self.cache.manager.block_ids(request.request_id)
            size = self.cache.block_size
            slots = [blocks[p // size] * size + p % size for p in range(start, start + num_new)]
            store = PrefillStore(self.cache, torch.tensor(slots, device=device),
                                 torch.tensor(blocks, device=device), start + num_new)
        else:
            if request.request_id not in self.slab_of:
                self.slab_of[request.request_id] = self.cache.add_sequence()
            store = self.cache.view(self.slab_of[request.request_id])
        return self.model(ids, positions, store)

    def _decode(self, batch: list[Request], sampled: dict[int, int]) -> None:
        """One forward pass for the newest token of every decoding request, flat [num_seqs]."""
        device = self.model.device
        positions = [request.num_computed_tokens for request in batch]
        tokens = [request.token_ids(p, p + 1)[0] for request, p in zip(batch, positions)]
        if self.paged:
            size = self.cache.block_size
            slots = []
            for request, position in zip(batch, positions):
                blocks = self.cache.manager.block_ids(request.request_id)
                slots.append(blocks[position // size] * size + position % size)
            block_tables, seq_lens = self.cache.block_tables_tensor(
                [request.request_id for request in batch])
            store = DecodeStore(self.cache, torch.tensor(slots, device=device), block_tables,
                                seq_lens)
        else:
            store = ContiguousDecodeStore(self.cache, [self.slab_of[r.request_id] for r in batch])
        logits = self.model(torch.tensor(tokens, device=device),
                            torch.tensor(positions, device=device), store)
        for request, row in zip(batch, logits):
            sampled[request.request_id] = int(row.argmax())


class ContiguousDecodeStore:
    """KV store for one new token of each of a batch of requests, each in its own slab.

    Writes token i's K/V at [slab_i, position_i] and attends it over its slab's first
    position_i + 1 tokens (the per-request loop is what a padded batched kernel would do).
    """

    def __init__(self, cache: ContiguousKVCache, slabs: list[int]):
        self.cache, self.slabs = cache, slabs

    def attend(self, layer_index, query, key, value, positions):
        cache, slabs = self.cache, torch.tensor(self.slabs, device=query.device)
        cache.k[layer_index, slabs, positions] = key
        cache.v[layer_index, slabs, positions] = value
        outputs = []
        for i, (slab, position) in enumerate(zip(self.slabs, positions.tolist())):
            keys = cache.k[layer_index, slab, :position + 1]
            values = cache.v[layer_index, slab, :position + 1]
            outputs.append(grouped_attention(query[i:i + 1], keys, values,
                                             query_positions=positions[i:i + 1]))
            if layer_index == cache.config.num_hidden_layers - 1:
                cache.seq_lens[slab] = position + 1
        return torch.cat(outputs)


def serve(requests: Sequence[Request], kv: KVManager, executor: Executor,
          config: SchedulerConfig = SchedulerConfig(), bytes_per_token: int = 0,
          progress: bool | None = None) -> ServeResult:
    """Replay `requests` (by arrival time) through one strategy; returns its figures.

    Args:
        requests: the workload; copied, so the same list can go through several strategies.
        kv: the strategy's KV manager (fresh: nothing held).
        executor: `ModelExecutor` or `SimulatedExecutor`.
        config: max_num_seqs and max_num_batched_tokens.
        bytes_per_token: KV bytes per token (per GPU), only to label memory in bytes.
        progress: show a tqdm bar (default: for more than 2,000 requests); either way, only
            when stderr is a terminal (tqdm's `disable=None`), so logs and pipes stay clean.

    Returns:
        `ServeResult`; its requests end FINISHED or REJECTED, never stuck.

    Raises:
        RuntimeError: a step scheduled nothing twice in a row while requests wait (a scheduler
            bug; it cannot happen when every queued request fits an empty cache).
    """
    from tqdm.auto import tqdm

    pending = collections.deque(sorted((r.fresh_copy() for r in requests),
                                       key=lambda r: r.arrival_s))
    served = list(pending)
    scheduler = Scheduler(kv, config)
    series = StepSeries()
    now = pending[0].arrival_s if pending else 0.0
    events, idle_steps, started = 0, 0, time.perf_counter()
    wanted = progress if progress is not None else len(served) > 2000
    bar = tqdm(total=len(served), desc=kv.name, unit="req", leave=False,
               disable=None if wanted else True)
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            if not scheduler.add_request(pending.popleft()):
                bar.update(1)
        if not scheduler.has_unfinished():
            now = pending[0].arrival_s  # idle: jump to the next arrival
            continue
        output = scheduler.schedule()
        for request in output.preempted:
            executor.release(request)
        if not output.scheduled:
            idle_steps += 1
            if idle_steps > 1:
                raise RuntimeError(f"scheduler stuck at t={now:.3f} s: {len(scheduler.waiting)} "
                                   f"waiting, {len(scheduler.running)} running")
            continue  # the only running request preempted itself; next step re-admits it
        idle_steps = 0
        sampled, seconds = executor.execute(output)
        # Memory during the step, before finished requests free theirs.
        reserved = kv.num_reserved_tokens
        used = sum(r.num_computed_tokens for r in scheduler.running) + output.num_batched_tokens
        running = len(scheduler.running)
        now += seconds
        finished = scheduler.update(output, sampled, now)
        for request in finished:
            executor.release(request)
        events += len(output.scheduled)
        series.record(now, seconds, running, len(scheduler.waiting), reserved, used)
        if finished:
            bar.update(len(finished))
    bar.close()
    hits = scheduler.num_hit_tokens if kv.has_prefix_cache else None
    return summarize(kv.name, served, series, scheduler.num_preemptions,
                     scheduler.num_recomputed_tokens, hits, scheduler.num_queried_tokens,
                     kv.capacity_tokens, bytes_per_token, time.perf_counter() - started, events)


def simulated_manager(strategy: str, kv_budget_bytes: int, bytes_per_token: int,
                      max_model_len: int, block_size: int = 16) -> KVManager:
    """A strategy's KV manager for a budget, with no tensors (simulation mode).

    Raises:
        ValueError: unknown strategy, or the budget cannot hold one max_model_len request.
    """
    if strategy == "contiguous":
        return ContiguousManager(kv_budget_bytes // (max_model_len * bytes_per_token),
                                 max_model_len)
    num_blocks = kv_budget_bytes // (block_size * bytes_per_token)
    if num_blocks < 1:
        raise ValueError(f"the KV budget of {kv_budget_bytes:,} B holds no block of "
                         f"{block_size} tokens x {bytes_per_token:,} B")
    if strategy == "paged":
        return PagedManager(SlotlessKVCacheManager(num_blocks, block_size), max_model_len)
    if strategy == "prefix":
        return PrefixManager(SlotlessPrefixCachingManager(num_blocks, block_size), max_model_len)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


class SlotlessPrefixCachingManager(PrefixCachingKVCacheManager):
    """`PrefixCachingKVCacheManager` for simulation: same blocks and hits, no slot lists built."""

    _reserve = SlotlessKVCacheManager._reserve


def model_strategy(strategy: str, model, kv_budget_bytes: int, max_model_len: int,
                   block_size: int = 16, cost_model: CostModel | None = None
                   ) -> tuple[KVManager, ModelExecutor]:
    """A strategy's KV manager and a `ModelExecutor` over real cache tensors of `kv_budget_bytes`.

    Raises:
        ValueError: unknown strategy, or the budget cannot hold one max_model_len request.
    """
    config = model.config
    bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                       * config.head_dim * model.dtype.itemsize)
    manager = simulated_manager(strategy, kv_budget_bytes, bytes_per_token, max_model_len,
                                block_size)
    if strategy == "contiguous":
        cache = ContiguousKVCache(config, manager.num_slabs, max_model_len, dtype=model.dtype,
                                  device=model.device)
    else:
        cache = PagedKVCache(config, manager.manager.pool.num_blocks, block_size,
                             dtype=model.dtype, device=model.device)
        if strategy == "paged":
            manager = PagedManager(cache.manager, max_model_len)
        else:  # the same pool tensors, bookkept by the prefix-caching manager
            cache.manager = PrefixCachingKVCacheManager(cache.num_blocks, block_size)
            manager = PrefixManager(cache.manager, max_model_len)
    executor = ModelExecutor(model, cache, cost_model)
    executor.bytes_per_token = bytes_per_token
    return manager, executor
