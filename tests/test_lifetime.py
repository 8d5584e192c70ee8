"""One definition of tokens held: `kvlab.lifetime`, used by `kvlab report`, is what the paged
engine really holds. A few requests are replayed through `LLMEngine` and, at every step, the
tokens and block slots each sequence holds are read from the cache itself."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.lifetime import decode_steps, held_token_steps, tokens_held
from kvlab.serving import LLMEngine
from kvlab.report import ContiguousStrategy, PagedStrategy, replay
from kvlab.workload import Request


def test_tokens_held_by_hand():
    # P=3, G=2: the prefill holds the 3 prompt tokens, the one decode step 4 (the second output
    # token is sampled there and never fed back).
    assert list(tokens_held(Request(3, 2))) == [3, 4]
    assert list(tokens_held(Request(3, 1))) == [3]   # prefill samples the only token
    assert list(tokens_held(Request(3, 0))) == [3]   # prefill only
    assert decode_steps(Request(3, 0)) == decode_steps(Request(3, 1)) == 1
    assert held_token_steps(Request(3, 2)) == 7


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 300), st.integers(0, 300))
def test_closed_form_equals_the_sum(prompt_len, output_len):
    request = Request(prompt_len, output_len)
    assert held_token_steps(request) == sum(tokens_held(request))
    assert len(tokens_held(request)) == decode_steps(request)


def replay_through_engine(model, requests, block_size):
    """Run the requests through an LLMEngine with a pool large enough that nothing is preempted.

    Returns {request index: [(tokens held, block slots reserved) at each step]}, read from the
    cache's block tables after each step and, for a sequence that finishes, just before its blocks
    are freed.
    """
    num_blocks = sum(-(-r.total_len // block_size) for r in requests) + 1
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=block_size,
                       max_model_len=max(r.total_len for r in requests))
    for index, request in enumerate(requests):
        prompt = [(7 * index + t) % model.config.vocab_size for t in range(request.prompt_len)]
        assert engine.add_request(prompt, request.output_len) == index
    manager = engine.cache.manager
    seen = collections.defaultdict(list)

    def holding(seq_id):
        return manager.num_tokens(seq_id), len(manager.block_ids(seq_id)) * block_size

    free = manager.free

    def free_and_record(request):  # the scheduler's free (finished): record what it held
        seen[request.request_id].append(holding(request.request_id))
        free(request)

    manager.free = free_and_record
    while engine.has_unfinished():
        engine.step()
        for seq in engine.running:  # n = 1: a sequence's id is its request's index
            seen[seq.request_id].append(holding(seq.request_id))
    assert engine.stats.num_preemptions == 0
    return seen


def test_report_counts_equal_what_the_paged_engine_holds(tiny_model):
    block_size = 4
    # Prefill-only-like (G = 1), block-boundary crossings, a prompt filling whole blocks.
    requests = [Request(5, 1), Request(1, 6), Request(8, 9), Request(13, 20), Request(4, 4)]
    seen = replay_through_engine(tiny_model, requests, block_size)
    paged = PagedStrategy(block_size, bytes_per_token=1)
    for index, request in enumerate(requests):
        held = [tokens for tokens, _ in seen[index]]
        assert held == list(tokens_held(request)), (index, request)
        slots = [reserved for _, reserved in seen[index]]
        assert sum(slots) == paged.reserved_token_steps(request), (index, request)

    max_model_len = 64
    report = replay(requests, [ContiguousStrategy(max_model_len, 1), paged], max_model_len,
                    kv_budget_bytes=10**6)
    engine_steps = sum(len(steps) for steps in seen.values())
    engine_held = sum(tokens for steps in seen.values() for tokens, _ in steps)
    engine_slots = sum(slots for steps in seen.values() for _, slots in steps)
    contiguous, paged_row = report.rows
    assert contiguous.waste == pytest.approx(1 - engine_held / (engine_steps * max_model_len),
                                             abs=1e-12)
    assert paged_row.waste == pytest.approx(1 - engine_held / engine_slots, abs=1e-12)
    assert paged_row.kv_used_bytes == round(engine_held / engine_steps)
    assert paged_row.kv_reserved_bytes == round(engine_slots / engine_steps)
