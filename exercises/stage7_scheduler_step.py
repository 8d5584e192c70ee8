# Stage 7 exercise, generated from solutions/stage7_scheduler_step.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 7`.

"""Stage 7 exercise: the admission and preemption decision of one scheduler step.

A continuous-batching server rebuilds its batch at every step (Orca's iteration-level scheduling;
vLLM v1's scheduler). Each step has two budgets: `max_num_batched_tokens` tokens computed in one
forward pass, and `max_num_seqs` requests running at once. Memory is asked for through the KV
cache manager, with vLLM v1's verbs (`kvlab.paged.KVCacheManager`): `allocate_slots(request, n)`
answers None when there is no room now for n more tokens, and changes nothing then;
`get_computed_blocks(request)` gives (blocks, num_computed_tokens) already cached (prefix caching;
else ([], 0)); `free(request)` lets its memory go.

A request knows two numbers: `num_tokens` (prompt + outputs so far) and `num_computed_tokens`
(those whose K/V are cached). A step gives each request min(num_tokens - num_computed_tokens,
tokens left in the budget) new tokens: one for a decode, a chunk for a prefill.

You write `schedule_step`, the decision of one step, with these rules:

1. Running requests first, oldest first (list order), while token budget is left. When
   `kv.allocate_slots(request, n)` fails, preempt the *newest* running request (the last of the
   list; it may be `request` itself), by recompute: `kv.free(victim)`, victim.num_computed_tokens = 0,
   victim.num_preemptions += 1, and put it at the *front* of the waiting queue. Retry until the
   append succeeds or `request` itself was preempted (then stop: nothing newer is left).
2. Only if nothing was preempted in this step: admit waiting requests from the front while token
   budget is left and fewer than max_num_seqs run. `blocks, cached = kv.get_computed_blocks(request)`,
   then `kv.allocate_slots(request, num_new, cached, blocks)` for num_new = min(num_tokens - cached,
   budget) tokens; None means the head waits, and nobody overtakes it. Otherwise it leaves the
   queue, joins the end of `running`, its num_computed_tokens becomes `cached` (a prefix-cache hit)
   and it computes those num_new tokens.

`kvlab check 7` runs yours and `kvlab.serving.Scheduler` on the same states and compares every
decision and the memory left. Read `src/kvlab/serving/scheduler.py` afterwards.
"""

from __future__ import annotations

import collections
from typing import Any


def schedule_step(running: list, waiting: collections.deque, kv: Any, max_num_seqs: int,
                  max_num_batched_tokens: int) -> tuple[list, list, list]:
    """Decide one step; updates `running`, `waiting` and the requests in place.

    Args:
        running: requests holding memory, oldest first (kvlab.serving.Request objects).
        waiting: arrived requests not running, in service order (a deque).
        kv: the KV cache manager (get_computed_blocks / allocate_slots / free).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in this step.

    Returns:
        (scheduled, admitted, preempted): scheduled is a list of (request, num_new_tokens) in
        execution order (running ones, then admitted ones); admitted and preempted are lists of
        requests, in the order it happened.
    """
    budget = max_num_batched_tokens
    scheduled: list = []
    preempted: list = []
    raise NotImplementedError("TODO(stage 7): rule 1: running requests first, oldest first, each given what it still needs up to the budget left; when the pool cannot grow one, free memory from the newest end (preempt by recompute, to the front of waiting) and retry; a request that preempted itself ends the pass, and so does a spent budget")

    admitted: list = []
    raise NotImplementedError("TODO(stage 7): rule 2: admit only in a step that preempted nobody (the preempted go first, and nobody overtakes the head of waiting); serve the head while the budget, max_num_seqs and the pool allow; its prefix-cache hit is tokens it does not compute, and the rest may be a chunk")
    return scheduled, admitted, preempted
