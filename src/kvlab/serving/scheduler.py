"""One scheduler for every KV-cache strategy: admit, run and preempt requests, one step at a time.

Iteration-level scheduling (Orca, Yu et al., OSDI 2022): the batch is rebuilt every step, so a
request joins as soon as memory allows and leaves the moment it finishes. A step has two budgets,
as in vLLM: `max_num_batched_tokens` tokens in one forward pass (a bigger prompt is computed in
chunks over several steps: chunked prefill, vLLM v1's default; Agrawal et al., Sarathi-Serve,
OSDI 2024) and `max_num_seqs` requests running at once. `schedule()`, after vLLM v1's:

1. Running requests, oldest first, each get the tokens they have not computed (1 for a decode, a
   chunk for a prefill) while the token budget lasts. When the KV manager has no room, the
   *newest* running request is preempted by recompute (Kwon et al., SOSP 2023, section 4.5): its
   memory is freed and it goes to the front of the waiting queue. The oldest always progress, so
   the server never livelocks.
2. `admit_waiting()`: waiting requests are admitted first come, first served, while the manager
   has room for the whole prompt (not just this step's chunk: `scheduler_reserve_full_isl`, vLLM
   0.32's default), max_num_seqs allows and token budget is left. A head that does not fit waits
   and nothing overtakes it, so it cannot starve. A step that preempted admits nobody, as in vLLM
   v1: the first in line, just preempted, would only be preempted again (thrashing). Prefix
   cache hits are counted at admission as vLLM v1 counts them (its `PrefixCacheStats.record`, via
   `KVCacheManager.record_prefix_cache_stats` after the allocation): first admissions make the
   prefix cache hit rate, and re-admissions after a preemption are counted apart (vLLM's
   `preempted_queries` / `preempted_hits`, which its hit rate leaves out), since they mostly find
   their own blocks again, still cached since the preemption freed them.

`update()` records the step: a request whose tokens are all computed has produced its next token;
one at max_output_tokens, or that sampled a stop token, finishes and frees its memory. A request
for n completions is admitted with its n - 1 forks (all n count against max_num_seqs), which fork
from it, sharing its KV, once its prompt is computed (section 4.4). Requests that can never fit
are rejected on arrival. The KV cache manager is called with vLLM v1's verbs
(`get_computed_blocks`, `allocate_slots`, `free`, `fork`), so one code runs the paged pool, with or
without a prefix cache, and the reservations (`reservation`).
"""

from __future__ import annotations

import collections
import dataclasses

from ..paged.kv_cache_manager import KVCacheManager
from .request import Request, RequestState

__all__ = ["SchedulerConfig", "SchedulerOutput", "Scheduler"]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The step budgets and the admission gate (vLLM's names and, in comments, its defaults)."""

    max_num_seqs: int = 256             # vLLM v1: 1,024 on large GPUs, 256 elsewhere
    max_num_batched_tokens: int = 8192  # vLLM v1 online: 8,192 on large GPUs, 2,048 elsewhere
    # Admit only if the whole input (prompt, or prompt and outputs after a preemption) fits in
    # the free blocks now, though only its first chunk gets slots (vllm/config/scheduler.py).
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass
class SchedulerOutput:
    """What one step runs."""

    # (request, num_new_tokens): its tokens num_computed_tokens .. + num_new_tokens - 1, running
    # requests first, then the ones admitted this step
    scheduled: list[tuple[Request, int]]
    admitted: list[Request]   # new, or back after a preemption
    preempted: list[Request]  # their memory is already freed
    num_batched_tokens: int   # sum of num_new_tokens
    # (source, destination) block ids to copy before the forward pass (copy-on-write; vLLM v0)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class Scheduler:
    """Continuous batching under a KV cache manager (or one with its verbs) and the budgets."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig = SchedulerConfig()):
        self.kv, self.config = kv, config
        # waiting: service order, preempted ones at the front; running: oldest admission first
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.rejected: list[Request] = []   # these two in the order they ended
        self.finished: list[Request] = []
        self.num_preemptions = 0
        self.num_unforked = 0  # forks admitted inside a running request, not yet made
        self.num_recomputed_tokens = 0
        # Prefix cache lookups at admission (module docstring, step 2)
        self.num_queried_tokens = 0   # tokens looked up at first admissions
        self.num_hit_tokens = 0       # of those, tokens found cached
        self.num_readmitted_queried_tokens = 0  # tokens looked up at re-admissions
        self.num_readmitted_hit_tokens = 0      # of those, tokens found cached

    def add_request(self, request: Request) -> bool:
        """Queue an arrived request; False if it can never fit (it and its forks REJECTED)."""
        reason = self.kv.reject_reason(request)
        if reason is not None:
            for member in (request, *request.forks):  # n completions of one prompt: all of them
                member.state, member.reject_reason = RequestState.REJECTED, reason
                self.rejected.append(member)
            return False
        request.state = RequestState.WAITING
        self.waiting.append(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        """Sequences admitted: running requests + forks admitted with them, not yet made."""
        return len(self.running) + self.num_unforked

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: 1. and 2. of the module docstring."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        # Run for every token served, so written out: `for` over a list whose tail is popped (the
        # victims) stops before them; prompt_len + num_output_tokens is `num_tokens`, inlined.
        allocate_slots = self.kv.allocate_slots
        for request in self.running:
            if budget <= 0:
                break
            num_new = request.prompt_len + request.num_output_tokens - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            while allocate_slots(request, num_new) is None:
                victim = self.running.pop()   # the newest; may be `request` itself
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                continue
            break  # `request` preempted itself: it was the newest, nothing is left after it

        admitted, budget = ([], budget) if preempted else self.admit_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, admitted, preempted,
                               self.config.max_num_batched_tokens - budget, self.kv.take_copies())

    def admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]
                      ) -> tuple[list[Request], int]:
        """Step 2: admit from the queue's head into `scheduled`; (admitted, token budget left)."""
        admitted: list[Request] = []
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self.num_running_seqs + request.num_seqs > self.config.max_num_seqs:
                break
            # vLLM v1's admission: the blocks already computed (prefix cache), then room for the
            # rest, as much of it as the token budget allows (>= 1: a hit never covers the last).
            blocks, cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - cached, budget)
            if self.kv.allocate_slots(request, num_new, cached, blocks,
                                      self.config.scheduler_reserve_full_isl) is None:
                break  # the head waits for memory; no overtaking
            self.waiting.popleft()
            if request.num_preemptions:
                self.num_readmitted_queried_tokens += request.num_tokens
                self.num_readmitted_hit_tokens += cached
            else:
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += cached
            request.state = RequestState.RUNNING
            request.num_computed_tokens = request.num_cached_tokens = cached
            self.num_unforked += len(request.forks)
            self.running.append(request)
            admitted.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return admitted, budget

    def _preempt(self, request: Request) -> None:
        """Recompute preemption (vLLM v1): free its KV, reset its progress, queue it first."""
        self.kv.free(request)
        self.num_recomputed_tokens += request.num_computed_tokens
        self.num_unforked -= len(request.forks)  # they wait with it
        self.num_preemptions += 1
        request.num_preemptions += 1
        request.num_computed_tokens = 0
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)  # several in one step keep their relative order

    def update(self, output: SchedulerOutput, sampled: dict[int, int] | None,
               now_s: float) -> list[Request]:
        """Record the step; the requests finished. `sampled`: request_id -> token id (model mode;
        forks made this step included), or None (simulation); `now_s`: the step's end."""
        done = []
        for request, num_new in output.scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.prompt_len + request.num_output_tokens:
                continue  # a prefill chunk: no token yet
            if request.forks:
                family = [request] + self._fork(request)
            elif sampled is None and request.first_token_s is not None and (
                    request.num_output_tokens + 1 < request.max_output_tokens):
                request.num_output_tokens += 1  # `_record_token` of a simulated middle token
                continue
            else:
                family = [request]
            for member in family:
                token = None if sampled is None else sampled[member.request_id]
                if self._record_token(member, token, now_s):
                    done.append(member)
        for request in done:
            self.running.remove(request)
        self.finished += done
        return done

    def _fork(self, parent: Request) -> list[Request]:
        """The parent's prompt is computed: its forks take over its KV and start running."""
        forks, parent.forks = parent.forks, []
        self.num_unforked -= len(forks)
        for child in forks:
            self.kv.fork(parent, child)
            child.state = RequestState.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            self.running.append(child)
        return forks

    def _record_token(self, request: Request, token: int | None, now_s: float) -> bool:
        """Append one output token; finish (and free) the request if it is done. True if done."""
        if token is not None:
            request.output_token_ids.append(token)
        request.num_output_tokens += 1
        if request.first_token_s is None:
            request.first_token_s = now_s
        if token is not None and token in request.sampling.stop_token_ids:
            request.finish_reason = "stop"
        elif request.num_output_tokens >= request.max_output_tokens:
            request.finish_reason = "length"
        else:
            return False
        request.state, request.finish_s = RequestState.FINISHED, now_s
        self.kv.free(request)
        return True
