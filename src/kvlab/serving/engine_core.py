"""The engine core: the serving loop, the two ways to execute a step, and the strategy factory.

`serve` is the whole server in one loop (vLLM v1's `EngineCore`, cut to its core):

    while requests are pending or unfinished:
        queue every request that has arrived by now (reject the ones that can never fit)
        output  = scheduler.schedule()          # decides: who runs, how many tokens, who is preempted
        sampled = executor.execute(output)      # executes: a forward pass, or the cost model's time
        now    += the step's time
        scheduler.update(output, sampled, now)  # records: new tokens, finished requests freed

The scheduler and the KV managers are the same in both modes; only the executor differs:

* `ModelRunner` (model mode, `kvlab.serving.model_runner`) runs the real model, with K/V
  written to and read from the real cache tensors, and samples each request's next token. The
  step time is the wall clock, or a cost model's (so runs are repeatable).
* `SimulatedExecutor` (simulation mode) runs nothing: the cost model (`cost_model.CostModel`) says
  how long the step would take on a named card, so a 19,366-request trace replays in seconds.

A strategy (`STRATEGIES`) is built in one place, `simulated_manager`: its KV manager for a budget,
with no tensors behind it; `model_strategy` puts real cache tensors and a `ModelRunner` behind
the same manager.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import time
from typing import Callable, Protocol, Sequence

from ..contiguous import ContiguousKVCache
from ..paged.kv_cache_manager import KVCacheManager
from ..paged.paged_cache import PagedKVCache
from ..prefix.block_hash import HashFunction, sha256
from ..prefix.manager import PrefixCachingKVCacheManager
from .cost_model import CostModel
from .reservation import ContiguousManager, KVManager
from .metrics import ServeResult, StepSeries, summarize
from .model_runner import ModelRunner
from .request import Request
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Executor", "SimulatedExecutor", "StepResult", "engine_step", "serve", "STRATEGIES",
           "simulated_manager", "paged_manager", "model_strategy"]

STRATEGIES = ("contiguous", "paged", "prefix")

_computed = operator.attrgetter("num_computed_tokens")  # summed over the running, every step


class Executor(Protocol):
    """Runs one scheduled step: `execute` returns (request_id -> sampled token, or None in
    simulation; the step's seconds); `release` hears that a request's memory was freed."""

    def execute(self, output: SchedulerOutput) -> tuple[dict[int, int] | None, float]: ...

    def release(self, request: Request) -> None: ...


class SimulatedExecutor:
    """No tensors: the step takes the cost model's time; no token ids are produced."""

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model

    def execute(self, output: SchedulerOutput) -> tuple[None, float]:
        return None, self.cost_model.step_time_of(output.scheduled)

    def release(self, request: Request) -> None:
        pass


@dataclasses.dataclass
class StepResult:
    """One engine step: the decision (`output.scheduled` empty: nothing ran), the requests it
    finished, its seconds, and during it the requests running, the KV token slots held (before
    finished requests freed theirs) and, of those, the slots holding a token's K/V."""

    output: SchedulerOutput
    finished: list[Request]
    seconds: float = 0.0
    num_running: int = 0
    reserved_tokens: int = 0
    used_tokens: int = 0


def engine_step(scheduler: Scheduler, executor: Executor, now_s: float,
                on_scheduled: Callable[[SchedulerOutput], None] | None = None) -> StepResult:
    """One step of the engine core: decide, execute, record (the body of vLLM v1's busy loop).

    `serve` calls it for a trace arriving over time; `kvlab.serving.llm_engine.LLMEngine` calls it
    for a batch given up front. `now_s` is the clock at the start of the step (seconds);
    `on_scheduled`, if given, sees the decision before it runs (memory is at its fullest then).
    """
    output = scheduler.schedule()
    if on_scheduled is not None:
        on_scheduled(output)
    for request in output.preempted:
        executor.release(request)  # preempted: its slab (contiguous) is free again
    if not output.scheduled:
        return StepResult(output, [])
    sampled, seconds = executor.execute(output)
    # Memory during the step, before finished requests free theirs.
    reserved = scheduler.kv.num_reserved_tokens
    used = sum(map(_computed, scheduler.running)) + output.num_batched_tokens
    running = len(scheduler.running)
    finished = scheduler.update(output, sampled, now_s + seconds)
    for request in finished:
        executor.release(request)
    return StepResult(output, finished, seconds, running, reserved, used)


def serve(requests: Sequence[Request], kv: KVCacheManager | KVManager, executor: Executor,
          config: SchedulerConfig = SchedulerConfig(), bytes_per_token: int = 0,
          progress: bool | None = None) -> ServeResult:
    """Replay `requests` (by arrival time) through one strategy; returns its figures.

    Args:
        requests: the workload; copied, so the same list can go through several strategies.
        kv: the strategy's KV manager (fresh: nothing held).
        bytes_per_token: KV bytes per token (per GPU), only to label memory in bytes.
        progress: a tqdm bar (default: over 2,000 requests), only when stderr is a terminal.

    Returns:
        `ServeResult`; its requests end FINISHED or REJECTED, never stuck.

    Raises:
        RuntimeError: a step scheduled nothing twice in a row while requests wait (a bug).
    """
    from tqdm.auto import tqdm

    pending = collections.deque(sorted((r.fresh_copy() for r in requests),
                                       key=lambda r: r.arrival_s))
    served = [member for request in pending for member in (request, *request.forks)]
    scheduler = Scheduler(kv, config)
    series = StepSeries()
    now = pending[0].arrival_s if pending else 0.0
    events, idle_steps, started = 0, 0, time.perf_counter()
    wanted = progress if progress is not None else len(served) > 2000
    bar = tqdm(total=len(served), desc=kv.name, unit="req", leave=False,
               disable=None if wanted else True)
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            if not scheduler.add_request(request):
                bar.update(request.num_seqs)
        if not scheduler.has_unfinished():
            now = pending[0].arrival_s  # idle: jump to the next arrival
            continue
        step = engine_step(scheduler, executor, now)
        if not step.output.scheduled:
            idle_steps += 1
            if idle_steps > 1:
                raise RuntimeError(f"scheduler stuck at t={now:.3f} s: {len(scheduler.waiting)} "
                                   f"waiting, {len(scheduler.running)} running")
            continue  # the only running request preempted itself; next step re-admits it
        idle_steps = 0
        now += step.seconds
        events += len(step.output.scheduled)
        series.record(now, step.seconds, step.num_running, len(scheduler.waiting),
                      step.reserved_tokens, step.used_tokens)
        if step.finished:
            bar.update(len(step.finished))
    bar.close()
    hits = scheduler.num_hit_tokens if kv.has_prefix_cache else None
    return summarize(kv.name, served, series, scheduler.num_preemptions,
                     scheduler.num_recomputed_tokens, hits, scheduler.num_queried_tokens,
                     kv.capacity_tokens, bytes_per_token, time.perf_counter() - started, events)


def simulated_manager(strategy: str, kv_budget_bytes: int, bytes_per_token: int,
                      max_model_len: int, block_size: int = 16,
                      hash_fn: HashFunction = sha256) -> KVCacheManager | KVManager:
    """The one factory of a strategy's KV manager, for a budget: slabs of max_model_len tokens
    ("contiguous", stage 2), blocks ("paged", stage 4), blocks shared by prefix ("prefix",
    stage 6). No tensors behind it (simulation); `model_strategy` gives it a cache. Raises
    ValueError (unknown strategy, a budget of no block) or KVCacheOutOfMemory (no room for one
    max_model_len request)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "contiguous":
        return ContiguousManager(kv_budget_bytes // (max_model_len * bytes_per_token),
                                 max_model_len)
    num_blocks = kv_budget_bytes // (block_size * bytes_per_token)
    if num_blocks < 1:
        raise ValueError(f"the KV budget of {kv_budget_bytes:,} B holds no block of "
                         f"{block_size} tokens x {bytes_per_token:,} B")
    return paged_manager(num_blocks, block_size, max_model_len, strategy == "prefix", hash_fn)


def paged_manager(num_blocks: int, block_size: int, max_model_len: int,
                  enable_prefix_caching: bool = False,
                  hash_fn: HashFunction = sha256) -> KVCacheManager:
    """The paged strategy's manager for a pool counted in blocks (stage 4's, or stage 6's)."""
    if enable_prefix_caching:
        return PrefixCachingKVCacheManager(num_blocks, block_size, max_model_len, hash_fn)
    return KVCacheManager(num_blocks, block_size, max_model_len)


def model_strategy(strategy: str, model, kv_budget_bytes: int, max_model_len: int,
                   block_size: int = 16, cost_model: CostModel | None = None
                   ) -> tuple[KVCacheManager | KVManager, ModelRunner]:
    """A strategy's KV manager (`simulated_manager`, same errors) and a `ModelRunner` over real
    cache tensors of `kv_budget_bytes` (a paged cache is given the manager the scheduler drives)."""
    config = model.config
    bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                       * config.head_dim * model.dtype.itemsize)
    manager = simulated_manager(strategy, kv_budget_bytes, bytes_per_token, max_model_len,
                                block_size)
    if strategy == "contiguous":
        cache = ContiguousKVCache(config, manager.num_slabs, max_model_len, dtype=model.dtype,
                                  device=model.device)
    else:
        cache = PagedKVCache(config, manager.pool.num_blocks, block_size, dtype=model.dtype,
                             device=model.device, manager=manager)
    executor = ModelRunner(model, cache, cost_model)
    executor.bytes_per_token = bytes_per_token
    return manager, executor
