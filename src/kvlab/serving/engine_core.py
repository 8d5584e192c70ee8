"""The engine core: one step (decide, execute, record) and the serving loop around it.

`serve` is the whole server in one loop, `replay` (vLLM v1's `EngineCore`, cut to its core):

    while requests are pending or unfinished:
        queue every request that has arrived by now (reject the ones that can never fit)
        output  = scheduler.schedule()          # decides: who runs, how many tokens, who is preempted
        sampled = executor.execute(output)      # executes: a forward pass, or the cost model's time
        now    += the step's time
        scheduler.update(output, sampled, now)  # records: new tokens, finished requests freed

Scheduler and KV managers are the same in both modes; only the executor differs. Model mode's
`ModelRunner` runs the real model over real cache tensors (step time: the wall clock, or a cost
model's, repeatable); simulation's `SimulatedExecutor` runs nothing, the step taking the time
`cost_model.CostModel` gives on a named card, so a 19,366-request trace replays in seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import os
import sys
import time
from typing import Callable, Protocol, Sequence

from ..paged.kv_cache_manager import KVCacheManager
from .cost_model import CostModel
from .metrics import ServeResult, StepSeries, summarize
from .request import Request
from .reservation import KVManager
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Executor", "SimulatedExecutor", "StepResult", "engine_step", "serve", "replay",
           "shared_tokens"]

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
    finished requests freed theirs) and, of those, the slots holding a token's K/V (a slot that
    several requests share, a prefix block, counted once)."""

    output: SchedulerOutput
    finished: list[Request]
    seconds: float = 0.0
    num_running: int = 0
    reserved_tokens: int = 0
    used_tokens: int = 0
    # requests the step advanced besides output.scheduled (kvlab.lazy_decode's decodes)
    num_lazy: int = 0


def shared_tokens(kv: KVCacheManager | KVManager) -> int:
    """Token slots that requests' own counts hold twice or more (blocks shared by a fork or a
    prefix-cache hit, once per extra holder: `KVCacheManager.num_shared_tokens`); 0 for a manager
    of slabs, which shares nothing between requests."""
    return getattr(kv, "num_shared_tokens", 0)


def engine_step(scheduler: Scheduler, executor: Executor, now_s: float,
                on_scheduled: Callable[[SchedulerOutput], None] | None = None) -> StepResult:
    """Decide, execute, record (vLLM v1's busy loop's body). `now_s`: the clock at its start (s);
    `on_scheduled`, if given, sees the decision before it runs (memory is at its fullest then)."""
    output = scheduler.schedule()
    if on_scheduled is not None:
        on_scheduled(output)
    for request in output.preempted:
        executor.release(request)  # preempted: its memory is free again
    if not output.scheduled:
        return StepResult(output, [])
    sampled, seconds = executor.execute(output)
    # Memory during the step, before finished requests free theirs.
    reserved = scheduler.kv.num_reserved_tokens
    used = (sum(map(_computed, scheduler.running)) + output.num_batched_tokens
            - shared_tokens(scheduler.kv))
    running = len(scheduler.running)
    finished = scheduler.update(output, sampled, now_s + seconds)
    for request in finished:
        executor.release(request)
    return StepResult(output, finished, seconds, running, reserved, used)


def serve(requests: Sequence[Request], kv: KVCacheManager | KVManager, executor: Executor,
          config: SchedulerConfig = SchedulerConfig(), bytes_per_token: int = 0,
          progress: bool | None = None) -> ServeResult:
    """Replay `requests` (copied, so one list serves several strategies) by arrival time through a
    fresh KV manager; all end FINISHED or REJECTED. RuntimeError: nothing ran twice in a row.
    bytes_per_token (per GPU) labels bytes; progress: a tqdm bar (default: over 2,000 requests)."""
    pending = collections.deque(sorted((r.fresh_copy() for r in requests),
                                       key=lambda r: r.arrival_s))
    served = [member for request in pending for member in (request, *request.forks)]
    scheduler = Scheduler(kv, config)
    return replay(pending, served, scheduler, functools.partial(engine_step, scheduler, executor),
                  bytes_per_token, progress)


def _bar_columns() -> int | None:
    """tqdm's width: its own choice, except on a terminal that reports 0 columns (a pseudo-terminal
    nobody sized, as an IDE's or a test harness's), where it would draw nothing at all."""
    try:
        return None if os.get_terminal_size(sys.stderr.fileno()).columns else 80
    except (OSError, ValueError, AttributeError):  # not a terminal (a notebook, a pipe, a file)
        return None


def replay(pending: collections.deque, served: list[Request], scheduler: Scheduler,
           step_at: Callable[[float], StepResult], bytes_per_token: int = 0,
           progress: bool | None = None) -> ServeResult:
    """`serve`'s loop: arrivals join the scheduler when the clock reaches them, and
    `step_at(now)` runs one step (`engine_step`, or `kvlab.lazy_decode`'s own)."""
    from tqdm.auto import tqdm

    kv = scheduler.kv
    series = StepSeries()
    now = pending[0].arrival_s if pending else 0.0
    events, idle_steps, started = 0, 0, time.perf_counter()
    wanted = progress if progress is not None else len(served) > 2000
    bar = tqdm(total=len(served), desc=kv.name, unit="req", leave=False,
               disable=None if wanted else True, ncols=_bar_columns())
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_s <= now:
            request = pending.popleft()
            if not scheduler.add_request(request):
                bar.update(request.num_seqs)
        if not scheduler.has_unfinished():
            if pending:  # idle: jump to the next arrival (none left: every one was rejected)
                now = pending[0].arrival_s
            continue
        step = step_at(now)
        if not step.output.scheduled and not step.num_lazy:
            idle_steps += 1
            if idle_steps > 1:
                raise RuntimeError(f"scheduler stuck at t={now:.3f} s: {len(scheduler.waiting)} "
                                   f"waiting, {len(scheduler.running)} running")
            continue  # the only running request preempted itself; next step re-admits it
        idle_steps = 0
        now += step.seconds
        events += len(step.output.scheduled) + step.num_lazy
        series.record(now, step.seconds, step.num_running, len(scheduler.waiting),
                      step.reserved_tokens, step.used_tokens)
        if step.finished:
            bar.update(len(step.finished))
    bar.close()
    cached = kv.has_prefix_cache
    return summarize(kv.name, served, series, scheduler.num_preemptions,
                     scheduler.num_recomputed_tokens,
                     scheduler.num_hit_tokens if cached else None, scheduler.num_queried_tokens,
                     kv.capacity_tokens, bytes_per_token, time.perf_counter() - started, events,
                     scheduler.num_readmitted_hit_tokens if cached else None,
                     scheduler.num_readmitted_queried_tokens)
