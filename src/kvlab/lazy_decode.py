"""Simulation's fast path: `serve` with decoding requests advanced lazily, the same result.

A replay of the Azure trace at 70B TP4 runs about 10,000 steps of 400 running requests; almost all
of that is requests decoding one token, each step touching every one of them (its progress, its
block table, its share of the step's time). A decoding request's step is predictable: +1 computed
token, +1 output token, +1 slot in its last block. Only a few of its steps do anything else: the one
that needs a new block (every `block_size` tokens) and the one that produces its last token (it
finishes). Those are its *events*. The step that fills a block, where the prefix cache enters it,
is not one: the block is cached when the request wakes, before it takes a block, is preempted or
finishes. Nothing can tell the difference: the block holds an output token, whose stand-in id is
the request's own (`kvlab.prefix.trace_blocks`), so no other request can hit it, and the request
holds it, so it cannot be evicted.

So this loop keeps a decoding request *lazy* between events: its fields stay as they were when it
became lazy, and its true progress is that plus the steps since (a tick counter). Each step does
work only for the requests at an event, the ones still prefilling and the ones admitted, in the
order of the running list, through the scheduler's and the KV cache manager's own code
(`allocate_slots`, `Scheduler._preempt`, `admit_waiting`, `update`); the lazy ones enter the step's
time and memory figures as sums kept up to date. A lazy request that is preempted is made whole
first. Two kinds of step run as the ordinary `engine_step`, every request made whole: one that
starts with nothing running, and one where the token budget would run out before a lazy request
(admission keeps the running requests within the budget, so it does not arise). The decisions, the
step series and every request's times are exactly those of `kvlab.serving.engine_core.serve`, which
stays the code to read: `tests/test_lazy_decode.py` replays slices of both traces, each strategy,
both ways, and compares them step by step.

It takes the three strategies' managers (`KVCacheManager`, `PrefixCachingKVCacheManager`,
`ContiguousManager`) with `SimulatedExecutor`, and requests without forks; anything else goes to
`engine_core.serve`. `kvlab serve --simulate` calls it.
"""

from __future__ import annotations

import bisect
import collections
from typing import Sequence

from .paged.kv_cache_manager import KVCacheManager
from .prefix.manager import PrefixCachingKVCacheManager
from .serving import engine_core
from .serving.cost_model import CostModel
from .serving.metrics import ServeResult
from .serving.request import Request, RequestState
from .serving.reservation import ContiguousManager, KVManager
from .serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["serve"]

_LAZY_MANAGERS = (KVCacheManager, PrefixCachingKVCacheManager, ContiguousManager)


def serve(requests: Sequence[Request], kv: KVCacheManager | KVManager,
          executor: engine_core.Executor, config: SchedulerConfig = SchedulerConfig(),
          bytes_per_token: int = 0, progress: bool | None = None) -> ServeResult:
    """`engine_core.serve`'s result (same arguments, same errors), decoding requests lazily when
    the manager, the executor and the requests allow it (see the module docstring)."""
    if (type(executor) is not engine_core.SimulatedExecutor or type(kv) not in _LAZY_MANAGERS
            or any(request.forks for request in requests)):
        return engine_core.serve(requests, kv, executor, config, bytes_per_token, progress)
    return _LazyReplay(requests, kv, executor, config).run(bytes_per_token, progress)


class _LazyReplay:
    """`engine_core.serve`'s loop over one scheduler, with lazy decoding requests."""

    def __init__(self, requests, kv, executor, config):
        self.pending = collections.deque(sorted((r.fresh_copy() for r in requests),
                                                key=lambda r: r.arrival_s))
        self.served = list(self.pending)
        self.kv, self.executor = kv, executor
        self.step_time = executor.cost_model.step_time
        self.scheduler = Scheduler(kv, config)
        self.paged = isinstance(kv, KVCacheManager)
        self.prefix = isinstance(kv, PrefixCachingKVCacheManager)
        self.tick = 0  # lazy steps so far
        self.since: dict[int, int] = {}  # lazy request id -> tick at which it became lazy
        # tick -> (request, tick it became lazy): due then, unless woken since (preempted)
        self.events: dict[int, list[tuple[Request, int]]] = collections.defaultdict(list)
        self.lazy_computed = 0  # sum of the lazy requests' true num_computed_tokens
        self.active: list[Request] = []  # running, not lazy (prefilling, or at an event)
        self.order: dict[int, int] = {}  # request id -> its place in the running list
        self.num_admitted = 0

    # ---- lazy requests ----------------------------------------------------------------------

    def _make_lazy(self, request: Request) -> bool:
        """Make a decoding request lazy until its next event; False if it is not decoding."""
        if (request.state is not RequestState.RUNNING or request.first_token_s is None
                or request.num_computed_tokens != request.num_tokens - 1):
            return False
        steps = request.max_output_tokens - request.num_output_tokens  # to its last token
        if self.paged:
            table, size = self.kv.tables[request.request_id], self.kv.block_size
            free_slots = len(table.block_ids) * size - table.num_tokens
            if free_slots and self.kv.pool.blocks[table.block_ids[-1]].ref_count != 1:
                return False  # a shared last block: copy-on-write, left to the manager
            steps = min(steps, free_slots + 1)  # the step that takes a new block
        if steps == 1:
            return False  # its next step is an event: it stays active
        self.since[request.request_id] = self.tick
        self.events[self.tick + steps].append((request, self.tick))
        self.lazy_computed += request.num_computed_tokens
        return True

    def _wake(self, request: Request) -> None:
        """Bring a lazy request's fields up to the current tick; it is no longer lazy."""
        steps = self.tick - self.since.pop(request.request_id)
        request.num_computed_tokens += steps
        request.num_output_tokens += steps
        if self.paged:
            self.kv.tables[request.request_id].num_tokens += steps
        if self.prefix:  # the block it filled while lazy, if any, enters the prefix cache now
            self.kv.cache_blocks(request)
        self.lazy_computed -= request.num_computed_tokens

    def _place(self, request: Request) -> int:
        return self.order[request.request_id]

    def _due(self, tick: int) -> list[Request]:
        """The lazy requests whose event is at `tick` (those woken since are not)."""
        since = self.since
        return [request for request, lazy_since in self.events.pop(tick, ())
                if since.get(request.request_id) == lazy_since]

    def _wake_all(self) -> None:
        for tick in list(self.events):
            for request in self._due(tick):
                self._wake(request)
                self.active.append(request)

    def _settle(self, requests) -> None:
        """After a step: the running ones that decode become lazy, the others stay active."""
        self.active = [r for r in requests
                       if r.state is RequestState.RUNNING and not self._make_lazy(r)]

    def _number(self, admitted: list[Request]) -> None:
        for request in admitted:
            self.order[request.request_id] = self.num_admitted
            self.num_admitted += 1

    # ---- one step ---------------------------------------------------------------------------

    def _budget(self, active: list[Request], limit: int) -> tuple[list[int], int | None]:
        """Schedule's token budget over the running list, each lazy request taking one token:
        the tokens of each active request it reaches, in order, and the running index from
        which nothing is scheduled (None: everything is)."""
        running, consumed, last, plan = self.scheduler.running, 0, -1, []
        for request in active:
            index = bisect.bisect_left(running, self._place(request), key=self._place)
            consumed += index - last - 1
            if consumed >= limit:
                return plan, index - (consumed - limit)
            plan.append(min(request.num_tokens - request.num_computed_tokens, limit - consumed))
            consumed, last = consumed + plan[-1], index
            if consumed >= limit:
                return plan, index + 1
        consumed += len(running) - last - 1
        return plan, len(running) - (consumed - limit) if consumed > limit else None

    def _lazy_step(self, now: float) -> engine_core.StepResult | None:
        """One step with the lazy requests advanced by their sums; None (nothing changed) if the
        token budget would leave a lazy request out of the step."""
        scheduler, kv, running = self.scheduler, self.kv, self.scheduler.running
        limit = scheduler.config.max_num_batched_tokens
        due = self._due(self.tick + 1)
        for request in due:
            self._wake(request)
        active = sorted(self.active + due, key=self._place)
        plan, stop = [r.num_tokens - r.num_computed_tokens for r in active], None
        if len(self.since) + sum(plan) > limit:
            plan, stop = self._budget(active, limit)
            if stop is not None and any(r.request_id in self.since for r in running[stop:]):
                self.active = active
                return None
        # Schedule's running loop over the requests that do more than append a slot in place,
        # in running order: the lazy ones between them would only do that.
        scheduled, preempted = [], []
        for request, num_new in zip(active, plan):
            if request.state is not RequestState.RUNNING:
                continue  # preempted earlier in this step
            while kv.allocate_slots(request, num_new) is None:
                victim = running.pop()  # the newest; may be `request` itself
                if victim.request_id in self.since:
                    self._wake(victim)
                scheduler._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                continue
            break
        num_lazy = len(self.since)
        admitted = []
        if not preempted and stop is None:
            budget = limit - num_lazy - sum(n for _, n in scheduled)
            admitted, _ = scheduler.admit_waiting(budget, scheduled)
            self._number(admitted)
        if not scheduled and not num_lazy:
            self.active = []  # the only running request preempted itself: nothing ran
            return engine_core.StepResult(SchedulerOutput([], admitted, preempted, 0), [])
        # The scheduled requests' sizes as the cost model counts them, plus the lazy decodes':
        # each computes and samples 1 token, reading its computed ones and attending them + 1.
        tokens, computed, pairs, sampled = CostModel.step_sizes(scheduled)
        tokens += num_lazy
        computed += self.lazy_computed
        pairs += self.lazy_computed + num_lazy
        sampled += num_lazy
        seconds = self.step_time(tokens, computed, pairs, sampled)
        # held during the step: every running request's computed tokens and the step's own
        still_running = [r for r in active if r.state is RequestState.RUNNING] + admitted
        used = (self.lazy_computed + tokens + sum(r.num_computed_tokens for r in still_running)
                - engine_core.shared_tokens(kv))
        reserved, num_running = kv.num_reserved_tokens, len(running)
        output = SchedulerOutput(scheduled, admitted, preempted, tokens)
        finished = scheduler.update(output, None, now + seconds)
        self.tick += 1
        self.lazy_computed += num_lazy
        self._settle(still_running)
        return engine_core.StepResult(output, finished, seconds, num_running, reserved, used,
                                      num_lazy)

    def _full_step(self, now: float) -> engine_core.StepResult:
        """`engine_step` itself, every request whole."""
        self._wake_all()
        step = engine_core.engine_step(self.scheduler, self.executor, now)
        self._number(step.output.admitted)
        self._settle(self.scheduler.running)
        return step

    def _step(self, now: float) -> engine_core.StepResult:
        step = self._lazy_step(now) if self.scheduler.running else None
        return step if step is not None else self._full_step(now)

    def run(self, bytes_per_token: int, progress: bool | None) -> ServeResult:
        """`engine_core.replay`, the loop of `serve`, with this class's steps."""
        return engine_core.replay(self.pending, self.served, self.scheduler, self._step,
                                  bytes_per_token, progress)
