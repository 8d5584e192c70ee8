"""Stage 7: priority scheduling (vLLM's `--scheduling-policy priority`), one step and whole replays.

Grades `stage7_scheduler_step.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 7`. Each state is built twice, identically: the learner's `schedule_step` runs on one
copy, `reference_step` below on the other, and every decision is compared.

`reference_step` is vLLM v1's `Scheduler.schedule` (vllm/v1/core/sched/scheduler.py) cut to this
course's core and written the way vLLM writes it (an index over `running`, moved back when a
victim that already ran leaves), apart from the answer's form. It has both of vLLM's policies:
under "fcfs" it must decide exactly as `kvlab.serving.Scheduler` does, and each check verifies
that first (a failure there is the grader's bug, and says so); each policy scenario must also
decide differently under "fcfs", so an answer that ignores priorities cannot pass.
"""

from __future__ import annotations

import collections
import dataclasses
import random

import pytest

from kvlab.paged import KVCacheManager
from kvlab.prefix import PrefixCachingKVCacheManager
from kvlab.serving import Request, Scheduler, SchedulerConfig
from kvlab.tools.grading import assert_equal

BLOCK_SIZE = 4


@dataclasses.dataclass(eq=False)
class PriorityRequest(Request):
    """A request with vLLM's `priority` (lower is served first; vLLM's default is 0)."""

    priority: int = 0


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage7_scheduler_step.py")


def key(request) -> tuple:
    return (request.priority, request.arrival_s)


def reference_step(running, waiting, kv, max_num_seqs, max_num_batched_tokens, policy):
    """One step under vLLM's "fcfs" or "priority" policy; `waiting` is a list in service order."""
    budget, index = max_num_batched_tokens, 0
    scheduled: list[list] = []  # [request, tokens], in the order scheduled
    preempted: list = []
    while index < len(running) and budget > 0:
        request = running[index]
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        while kv.allocate_slots(request, num_new) is None:
            if policy == "priority":  # vLLM: max(self.running, key=(priority, arrival_time))
                victim = max(running, key=key)
                running.remove(victim)
                ran = [entry for entry in scheduled if entry[0] is victim]
                if ran:  # scheduled_running_reqs.remove, token_budget += ..., req_index -= 1
                    scheduled.remove(ran[0])
                    budget += ran[0][1]
                    index -= 1
            else:
                victim = running.pop()  # vLLM: self.running.pop()
            kv.free(victim)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            preempted.append(victim)
            if policy == "priority":  # PriorityRequestQueue.prepend_request: by its key
                waiting.append(victim)
                waiting.sort(key=key)
            else:
                waiting.insert(0, victim)
            if victim is request:
                break
        else:
            scheduled.append([request, num_new])
            budget -= num_new
            index += 1
            continue
        break
    admitted = []
    while not preempted and waiting and budget > 0 and len(running) < max_num_seqs:
        request = waiting[0]
        blocks, cached = kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - cached, budget)
        if kv.allocate_slots(request, num_new, cached, blocks, full_sequence_must_fit=True) is None:
            break
        waiting.pop(0)
        request.num_computed_tokens = cached
        running.append(request)
        admitted.append(request)
        scheduled.append([request, num_new])
        budget -= num_new
    return [tuple(entry) for entry in scheduled], admitted, preempted


def describe(scheduled, admitted, preempted, running, waiting, kv):
    return {"scheduled (id, tokens)": [(r.request_id, n) for r, n in scheduled],
            "admitted": [r.request_id for r in admitted],
            "preempted": [r.request_id for r in preempted],
            "running after": [r.request_id for r in running],
            "waiting after (service order)": [r.request_id for r in waiting],
            "num_computed_tokens after": {r.request_id: r.num_computed_tokens
                                          for r in [*running, *waiting]},
            "token slots held after": kv.num_reserved_tokens}


# A running request: (prompt, outputs sampled so far, priority, arrival_s): prefilled, its next
# token to compute; (prompt, -c, ...) is one c tokens into its prefill. A waiting one: (prompt,
# priority, arrival_s). Prompt token ids are (request id, position), except "shared", whose
# waiting requests start with running request 0's first 8 tokens (a prefix-cache hit).
SCENARIOS = {
    # name: (blocks, running, waiting, max_num_seqs, max_num_batched_tokens, what it checks)
    "the victim is the lowest priority, not the newest": (
        4, [(4, 1, 0, 0.0), (4, 1, 2, 1.0), (4, 1, 0, 2.0)], [], 8, 64,
        "request 1 (priority 2) needs a block and none is free: it has the lowest priority, so "
        "it preempts itself, though request 2 is newer, and the running pass ends there"),
    "the victim already ran this step: its tokens go back": (
        4, [(3, 1, 5, 0.0), (4, 1, 0, 1.0), (12, -6, 0, 2.0)], [], 8, 3,
        "request 0 (priority 5) decodes first; request 1 then needs a block: the victim is request "
        "0, taken off this step, its token back in the budget for request 2's prefill chunk"),
    "the victim is later in the list": (
        5, [(4, 1, 0, 0.0), (7, 1, 3, 1.0), (4, 1, 0, 2.0)], [], 8, 64,
        "request 0 needs a block: the victim is request 1 (priority 3), not yet visited; "
        "request 2 then runs as usual"),
    "equal priorities: the latest arrival, not the last admitted": (
        4, [(4, 1, 1, 0.0), (4, 1, 1, 3.0), (4, 1, 1, 1.0)], [], 8, 64,
        "request 2 arrived before request 1 but runs after it (admitted again after a "
        "preemption): the victim is request 1, the latest arrival"),
    "waiting served by priority, then arrival": (
        20, [(3, 1, 0, 0.0)], [(6, 2, 1.0), (5, 0, 2.0), (2, 1, 3.0), (3, 0, 4.0)], 3, 64,
        "admit in order of (priority, arrival): requests 2 and 4, then max_num_seqs=3 is reached"),
    "a head that does not fit blocks the rest": (
        5, [(7, 1, 1, 0.0)], [(2, 1, 1.0), (14, 0, 2.0)], 8, 64,
        "request 2 (priority 0) needs 4 blocks and 3 are free: it waits, and request 1 "
        "(priority 1) may not overtake it"),
    "a preempted request waits by its key, not at the front": (
        3, [(4, 1, 0, 0.0), (4, 1, 1, 1.0)], [(3, 0, 0.5)], 8, 64,
        "request 1 is preempted; in the queue it goes after request 2 (priority 0), not first"),
    "no admission in a step that preempted": (
        4, [(4, 1, 0, 0.0), (8, 1, 1, 1.0)], [(1, 0, 2.0)], 8, 64,
        "request 1 is preempted, so nobody is admitted, though request 2 would fit"),
    "the whole prompt must fit, not its first chunk": (
        8, [(8, 1, 0, 0.0), (3, 1, 1, 1.0)], [(24, 0, 2.0)], 8, 8,
        "request 2's 24-token prompt needs 6 blocks and 4 are free after the decodes: its first "
        "6-token chunk (2 blocks) would fit, but vLLM admits a request only if its whole input "
        "does"),
    "chunked prefill under the token budget": (
        40, [(3, 1, 0, 0.0), (2, 1, 0, 1.0)], [(12, 1, 2.0), (5, 0, 3.0)], 8, 8,
        "6 tokens are left after the decodes: request 3 (priority 0) gets 5, request 2 the "
        "last 1"),
    "a prefix-cache hit at admission": (
        "shared", [(12, 1, 0, 0.0)], [(10, 0, 1.0)], 8, 64,
        "request 1's first 8 tokens are request 0's: 2 blocks found cached, so it computes 2"),
}
# Where priority decides differently from FCFS (the other two check the gate and a prefix hit).
POLICY_SCENARIOS = [name for name in SCENARIOS if name not in (
    "the whole prompt must fit, not its first chunk", "a prefix-cache hit at admission")]


def build(name, policy="priority", waiting_type=list):
    """The scenario's manager, running list and waiting queue (sorted by the policy)."""
    blocks, running_sizes, waiting_sizes, *_ = SCENARIOS[name]
    shared = blocks == "shared"
    kv = PrefixCachingKVCacheManager(20, BLOCK_SIZE) if shared else KVCacheManager(blocks, BLOCK_SIZE)
    room = kv.capacity_tokens  # each request may grow to the whole pool (max_model_len)
    running, waiting = [], []
    for index, (prompt, outputs, priority, arrival) in enumerate(running_sizes):
        request = PriorityRequest(index, arrival, prompt, room - prompt,
                                  prompt_token_ids=[100 * index + i for i in range(prompt)],
                                  priority=priority)
        computed = -outputs if outputs < 0 else prompt + outputs - 1
        request.num_output_tokens = max(outputs, 0)
        assert kv.allocate_slots(request, computed) is not None, name
        request.num_computed_tokens = computed
        running.append(request)
    for index, (prompt, priority, arrival) in enumerate(waiting_sizes, start=len(running)):
        ids = [100 * index + i for i in range(prompt)]
        if shared:
            ids[:8] = running[0].prompt_token_ids[:8]
        waiting.append(PriorityRequest(index, arrival, prompt, room - prompt, prompt_token_ids=ids,
                                       priority=priority))
    if policy == "priority":
        waiting.sort(key=key)
    return kv, running, waiting_type(waiting)


def settings(name):
    _, _, _, seqs, tokens, why = SCENARIOS[name]
    return seqs, tokens, why


def learner_queue(ex, requests):
    queue = ex.PriorityRequestQueue()
    for request in requests:
        queue.add_request(request)
    return queue


def check_reference_against_kvlab(name):
    """The grader's own check: under FCFS the reference decides as kvlab.serving.Scheduler."""
    seqs, tokens, _ = settings(name)
    kv, running, waiting = build(name, "fcfs")
    ours = describe(*reference_step(running, waiting, kv, seqs, tokens, "fcfs"), running,
                    waiting, kv)
    kv, running, waiting = build(name, "fcfs", collections.deque)
    scheduler = Scheduler(kv, SchedulerConfig(seqs, tokens))
    scheduler.running, scheduler.waiting = running, waiting
    out = scheduler.schedule()
    kvlab = describe(out.scheduled, out.admitted, out.preempted, scheduler.running,
                     scheduler.waiting, kv)
    assert ours == kvlab, f"grader bug: the FCFS reference and kvlab differ on {name!r}"
    return ours


def expected_decisions(name):
    seqs, tokens, _ = settings(name)
    kv, running, waiting = build(name)
    return describe(*reference_step(running, waiting, kv, seqs, tokens, "priority"), running,
                    waiting, kv)


def test_priority_key_is_priority_then_arrival(ex):
    request = PriorityRequest(7, 2.5, 4, 4, priority=3)
    assert_equal(ex.priority_key(request), (3, 2.5),
                 "priority_key(request with priority=3, arrival_s=2.5)")


def test_queue_serves_by_priority_then_arrival(ex):
    sizes = [(0, 2, 0.0), (1, 0, 3.0), (2, 1, 1.0), (3, 0, 2.0), (4, 2, 0.5)]
    queue = learner_queue(ex, [PriorityRequest(i, t, 4, 4, priority=p) for i, p, t in sizes])
    what = "a PriorityRequestQueue given requests 0-4 with (priority, arrival_s) " + ", ".join(
        f"{i}: ({p}, {t})" for i, p, t in sizes)
    assert_equal(len(queue), 5, f"len() of {what}")
    assert_equal([r.request_id for r in queue], [3, 1, 2, 0, 4], f"iterating {what}")
    assert_equal(queue.peek_request().request_id, 3, f"peek_request() of {what}")
    assert_equal([queue.pop_request().request_id for _ in range(2)], [3, 1],
                 f"pop_request() twice from {what}")
    queue.prepend_request(PriorityRequest(5, 4.0, 4, 4, priority=1))
    assert_equal([r.request_id for r in queue], [2, 5, 0, 4],
                 f"{what}, 3 and 1 popped, then request 5 (1, 4.0) put back by prepend_request "
                 f"[a preempted request's place is its key]")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_step_decides_like_vllm_priority(ex, name):
    fcfs = check_reference_against_kvlab(name)
    expected = expected_decisions(name)
    if name in POLICY_SCENARIOS:
        assert fcfs != expected, f"grader bug: {name!r} decides alike under both policies"
    seqs, tokens, why = settings(name)
    kv, running, waiting = build(name)
    queue = learner_queue(ex, waiting)
    got = ex.schedule_step(running, queue, kv, seqs, tokens)
    assert isinstance(got, tuple) and len(got) == 3, \
        "schedule_step returns (scheduled, admitted, preempted)"
    _, running_sizes, waiting_sizes, *_ = SCENARIOS[name]
    assert_equal(describe(*got, running, queue, kv), expected,
                 f"scenario {name!r} [{why}]: running {in_words(running_sizes)}; waiting "
                 f"{in_words(waiting_sizes, start=len(running_sizes))}; "
                 f"max_num_seqs={seqs}, max_num_batched_tokens={tokens}")


def in_words(sizes, start=0):
    """A scenario's running or waiting requests as a learner reads them (not SCENARIOS' tuples)."""
    words = []
    for request_id, size in enumerate(sizes, start=start):
        if len(size) == 4:  # running: (prompt, outputs, priority, arrival_s)
            prompt, outputs, priority, arrival = size
            state = (f"{outputs} output(s)" if outputs >= 0 else
                     f"{-outputs} of its prompt tokens computed")
        else:               # waiting: (prompt, priority, arrival_s)
            (prompt, priority, arrival), state = size, "not started"
        words.append(f"request {request_id} (prompt {prompt}, {state}, priority {priority}, "
                     f"arrived {arrival} s)")
    return ", ".join(words) or "none"


def random_workload(rng):
    """12 requests: (arrival step, prompt, max output, priority); arrival_s = step + id / 100."""
    return sorted(((rng.randrange(8), rng.randrange(1, 25), rng.randrange(1, 13),
                    rng.randrange(3)) for _ in range(12)), key=lambda w: w[0])


def replay(workload, step, make_queue):
    """The workload through `step` (14 blocks of 4, 4 seqs, 16 tokens), one decision per step."""
    kv, running, waiting, steps = KVCacheManager(14, BLOCK_SIZE), [], make_queue(), []
    for now in range(200):
        for index, (arrival, prompt, output, priority) in enumerate(workload):
            if arrival == now:
                waiting.add_request(PriorityRequest(index, arrival + index / 100, prompt,
                                                    output, priority=priority))
        if now > workload[-1][0] and not (running or waiting):
            return steps
        decided = step(running, waiting, kv, 4, 16)
        steps.append(describe(*decided, running, waiting, kv))
        for request, num_new in decided[0]:  # the forward pass, then update()
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.num_output_tokens += 1
                if request.num_output_tokens == request.max_output_tokens:
                    kv.free(request)
                    running.remove(request)
    raise AssertionError(f"{workload}: not finished after 200 steps")


class ReferenceQueue(list):
    """The reference's waiting list, filled as the replay fills the learner's queue."""

    def add_request(self, request):
        self.append(request)
        self.sort(key=key)


def test_whole_replays_decide_like_vllm_priority(ex):
    rng = random.Random(7)
    for _ in range(60):
        workload = random_workload(rng)
        expected = replay(workload, lambda *args: reference_step(*args, "priority"),
                          ReferenceQueue)
        got = replay(workload, ex.schedule_step, ex.PriorityRequestQueue)
        step = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                    min(len(got), len(expected)))
        assert_equal(got[step:step + 1], expected[step:step + 1],
                     f"replay of (arrival step, prompt, max output, priority) {workload} in 14 "
                     f"blocks of 4, max_num_seqs=4, max_num_batched_tokens=16: step {step}")
