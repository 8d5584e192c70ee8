"""Stage 7 exercise: priority scheduling, the policy vLLM offers beside first come, first served.

Notebook 07's scheduler serves first come, first served (FCFS): the waiting queue's front is the
first arrived (or the last preempted), and when memory runs out the *newest* running request is
preempted. vLLM v1 offers a second policy, `--scheduling-policy priority` (`SchedulingPolicy
.PRIORITY` in vllm/v1/core/sched/scheduler.py; its queue in vllm/v1/core/sched/request_queue.py):
each request carries a `priority`, an int, lower served first (vLLM's default is 0), and the
scheduler changes in two places only:

* **the waiting queue** is served in order of (priority, arrival time): vLLM's
  `PriorityRequestQueue`, a heap, instead of FCFS's deque. A preempted request goes back in by its
  key, not to the front.
* **the victim of a preemption** is the running request with the largest (priority, arrival time):
  the lowest priority, and among equals the latest arrival, where FCFS takes the last admitted.
  The victim may already have been scheduled in this step: then it comes off this step's schedule
  and its tokens go back into the token budget (vLLM's `token_budget += num_scheduled_tokens[...]`).

Everything else is the page's step. Running requests first, in `running` order (admission
order), while token budget is left, each given min(num_tokens - num_computed_tokens, budget) new
tokens; a failed `kv.allocate_slots(request, n)` (None) preempts a victim and retries, and if the
victim is `request` itself, the running pass ends. Then, only in a step that preempted nobody,
waiting requests are admitted from the head of the queue with vLLM's whole-input gate
(`full_sequence_must_fit=True`), as on the page, after a prefix-cache lookup
(`kv.get_computed_blocks`), as kvlab's `Scheduler.admit_waiting` does.

You write `priority_key`, the queue and rule 1 of `schedule_step` (the running pass and its
victims); `preempt` (the page's recompute preemption) and rule 2 (admission, which takes the
queue's order from your `peek_request` and `pop_request`) are given. In the checks no two
requests arrive at the same instant, so keys never tie.
`kvlab check 7` runs yours beside a reference written after vLLM's code, on states where priority
and FCFS decide differently, then on whole random replays. Read vLLM's `schedule()` afterwards.
"""

from __future__ import annotations

import heapq
from typing import Any, Iterator


def priority_key(request: Any) -> tuple[int, float]:
    """The order of service: smaller first; the largest is preempted first."""
    # BEGIN SOLUTION hint: vLLM compares requests by priority, then by arrival time (arrival_s)
    return (request.priority, request.arrival_s)
    # END SOLUTION


class PriorityRequestQueue:
    """Waiting requests, served smallest `priority_key` first (vLLM's `PriorityRequestQueue`)."""

    def __init__(self) -> None:
        # BEGIN SOLUTION hint: a structure that gives back the smallest key first: vLLM keeps a
        # hint: heap (heapq) of requests; (key, request_id, request) tuples make one here
        self._heap: list = []
        # END SOLUTION

    def add_request(self, request: Any) -> None:
        """Queue an arrived request."""
        # BEGIN SOLUTION hint: put it in with its key
        heapq.heappush(self._heap, (priority_key(request), request.request_id, request))
        # END SOLUTION

    def prepend_request(self, request: Any) -> None:
        """Queue a preempted request (FCFS puts it at the front; here its place is its key)."""
        # BEGIN SOLUTION hint: in a priority queue there is no front to put it at
        self.add_request(request)
        # END SOLUTION

    def peek_request(self) -> Any:
        """The request served next, left in the queue."""
        # BEGIN SOLUTION hint: the smallest key, not removed
        return self._heap[0][-1]
        # END SOLUTION

    def pop_request(self) -> Any:
        """Remove and return the request served next."""
        # BEGIN SOLUTION hint: the smallest key, removed
        return heapq.heappop(self._heap)[-1]
        # END SOLUTION

    def __len__(self) -> int:
        # BEGIN SOLUTION hint: how many requests wait
        return len(self._heap)
        # END SOLUTION

    def __iter__(self) -> Iterator[Any]:
        """The waiting requests in service order (what is printed and checked)."""
        # BEGIN SOLUTION hint: every request, smallest key first, leaving the queue as it is
        return iter([entry[-1] for entry in sorted(self._heap)])
        # END SOLUTION


def preempt(victim: Any, kv: Any, waiting: PriorityRequestQueue, preempted: list) -> None:
    """Preemption by recompute, as on notebook 07's page (vLLM's `_preempt_request`): its K/V
    dropped, to be computed again, back in the waiting queue, and noted in `preempted`."""
    kv.free(victim)
    victim.num_computed_tokens = 0
    victim.num_preemptions += 1
    waiting.prepend_request(victim)
    preempted.append(victim)


def schedule_step(running: list, waiting: PriorityRequestQueue, kv: Any, max_num_seqs: int,
                  max_num_batched_tokens: int) -> tuple[list, list, list]:
    """Decide one step under the priority policy; updates `running`, `waiting` and the requests.

    Args:
        running: requests holding memory, in admission order: kvlab.serving.Request objects
            that also carry an int `priority` (the library's Request has no such field; the
            checks use a subclass with one; by hand, `request.priority = 1` on a Request works).
        waiting: arrived requests not running (a `PriorityRequestQueue`).
        kv: the KV cache manager (get_computed_blocks / allocate_slots / free).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in this step.

    Returns:
        (scheduled, admitted, preempted): scheduled is a list of (request, num_new_tokens) in the
        order they were scheduled (running ones, then admitted ones; a victim taken off it);
        admitted and preempted are lists of requests, in the order it happened.
    """
    budget = max_num_batched_tokens
    scheduled: dict = {}  # request -> its new tokens this step, in the order scheduled
    preempted: list = []
    # BEGIN SOLUTION hint: rule 1 (the module docstring). What must hold when the pass ends:
    # hint: each request scheduled got min(tokens it still needs, budget left) and its blocks, in
    # hint: `running` order; each victim had the largest key among those still running when chosen,
    # hint: and is in neither `running` nor `scheduled`; the budget counts only scheduled tokens;
    # hint: nothing after a request that preempted itself is scheduled. `running` shrinks as you go.
    for request in list(running):
        if budget <= 0:
            break
        if request not in running:
            continue  # a victim earlier in this pass
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        while kv.allocate_slots(request, num_new) is None:
            victim = max(running, key=priority_key)
            running.remove(victim)
            budget += scheduled.pop(victim, 0)  # it ran in this step already: undo that
            preempt(victim, kv, waiting, preempted)
            if victim is request:
                break
        else:
            scheduled[request] = num_new
            budget -= num_new
            continue
        break  # `request` preempted itself: it had the largest key left
    # END SOLUTION

    if preempted:  # memory is already short for those running: admit nobody
        return list(scheduled.items()), [], preempted
    # Rule 2, given: the page's admission plus the prefix-cache lookup of kvlab's Scheduler
    # (`admit_waiting`), taking requests in the queue's order.
    num_running = len(running)  # the requests admitted below join `running` after these
    while waiting and budget > 0 and len(running) < max_num_seqs:
        request = waiting.peek_request()
        blocks, cached = kv.get_computed_blocks(request)  # tokens it need not compute
        num_new = min(request.num_tokens - cached, budget)
        if kv.allocate_slots(request, num_new, cached, blocks, full_sequence_must_fit=True) is None:
            break  # the head waits for memory (its whole input must fit); nobody overtakes it
        waiting.pop_request()
        request.num_computed_tokens = cached
        running.append(request)
        scheduled[request] = num_new
        budget -= num_new
    return list(scheduled.items()), running[num_running:], preempted
