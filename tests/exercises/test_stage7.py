"""Stage 7: one scheduler step (admission and preemption), compared with `kvlab.serving.Scheduler`.

Grades `stage7_scheduler_step.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 7`. Each scenario is built twice, identically; the learner's `schedule_step` runs on
one copy, kvlab's `Scheduler.schedule` on the other, and every decision is compared.
"""

from __future__ import annotations

import collections

import pytest

from kvlab.tools.grading import assert_equal
from kvlab.serving import Request, Scheduler, SchedulerConfig, simulated_manager

BYTES_PER_TOKEN = 100


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage7_scheduler_step.py")


def build(strategy, num_blocks, running_sizes, waiting_sizes, block_size=4):
    """A manager of `num_blocks` blocks (slabs of 16 tokens for contiguous), requests already running (prompt,
    output so far; prefilled, one token to decode) and waiting requests (prompt, 0)."""
    tokens = num_blocks * (16 if strategy == "contiguous" else block_size)
    kv = simulated_manager(strategy, tokens * BYTES_PER_TOKEN, BYTES_PER_TOKEN, max_model_len=16,
                           block_size=block_size)
    running, waiting = [], collections.deque()
    for index, (prompt, outputs) in enumerate(running_sizes):
        request = Request(index, 0.0, prompt, 16 - prompt)
        assert kv.get_computed_blocks(request) == ([], 0)
        assert kv.allocate_slots(request, prompt) is not None
        request.num_computed_tokens = prompt
        for _ in range(outputs):  # decoded earlier: the cache holds prompt + outputs - 1 tokens
            request.num_output_tokens += 1
            if request.num_output_tokens > 1:
                assert kv.allocate_slots(request, 1) is not None
                request.num_computed_tokens += 1
        running.append(request)
    for index, prompt in enumerate(waiting_sizes, start=len(running_sizes)):
        waiting.append(Request(index, 0.0, prompt, max(1, 16 - prompt)))
    return kv, running, waiting


def describe(scheduled, admitted, preempted, running, waiting, kv):
    return {"scheduled (id, tokens)": [(r.request_id, n) for r, n in scheduled],
            "admitted": [r.request_id for r in admitted],
            "preempted": [r.request_id for r in preempted],
            "running after": [r.request_id for r in running],
            "waiting after": [r.request_id for r in waiting],
            "num_computed_tokens after": {r.request_id: r.num_computed_tokens
                                          for r in [*running, *waiting]},
            "token slots held after": kv.num_reserved_tokens}


SCENARIOS = {
    # name: (strategy, blocks, running (prompt, outputs so far), waiting prompts, seqs, tokens)
    "room for everyone": ("paged", 20, [(5, 1), (3, 2)], [6, 2], 8, 64),
    "pool dry: preempt the newest": ("paged", 4, [(4, 1), (4, 1), (4, 1), (4, 1)], [3], 8, 64),
    "the newest preempts itself": ("paged", 4, [(3, 1), (4, 1)], [2], 8, 64),
    "no admission right after a preemption": ("paged", 4, [(4, 1), (8, 1)], [], 8, 4),
    "head of line waits, nobody overtakes": ("paged", 6, [(7, 1), (7, 1)], [9, 1], 8, 64),
    "max_num_seqs": ("paged", 40, [(3, 1)], [2, 2, 2, 2], 3, 64),
    "token budget chunks a prompt": ("paged", 40, [(3, 1), (2, 1)], [12, 5], 8, 8),
    "token budget spent by decodes": ("paged", 40, [(3, 1), (2, 1), (5, 1)], [4], 8, 2),
    "contiguous slabs": ("contiguous", 3, [(4, 1)], [5, 6, 7], 8, 64),
    "prefix cache, no hit across requests": ("prefix", 20, [(5, 1)], [6, 6], 8, 64),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_step_decides_like_kvlab(ex, name):
    strategy, blocks, running_sizes, waiting_sizes, seqs, tokens = SCENARIOS[name]
    kv, running, waiting = build(strategy, blocks, running_sizes, waiting_sizes)
    got = ex.schedule_step(running, waiting, kv, seqs, tokens)
    assert isinstance(got, tuple) and len(got) == 3, \
        "schedule_step returns (scheduled, admitted, preempted)"

    kv_ref, running_ref, waiting_ref = build(strategy, blocks, running_sizes, waiting_sizes)
    scheduler = Scheduler(kv_ref, SchedulerConfig(seqs, tokens))
    scheduler.running, scheduler.waiting = running_ref, waiting_ref
    out = scheduler.schedule()
    expected = describe(out.scheduled, out.admitted, out.preempted, scheduler.running,
                        scheduler.waiting, kv_ref)
    assert_equal(describe(*got, running, waiting, kv), expected,
                 f"scenario {name!r}: {len(running_sizes)} running {running_sizes}, waiting "
                 f"prompts {waiting_sizes}, {blocks} {'slabs' if strategy == 'contiguous' else 'blocks'}"
                 f", max_num_seqs={seqs}, max_num_batched_tokens={tokens}")


def test_a_preempted_request_counts_its_preemption(ex):
    kv, running, waiting = build("paged", 4, [(4, 1)] * 4, [])
    newest = running[-1]
    ex.schedule_step(running, waiting, kv, 8, 64)
    assert_equal(newest.num_preemptions, 1, "num_preemptions of the preempted (newest) request")
