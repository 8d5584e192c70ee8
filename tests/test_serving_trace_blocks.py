"""Simulation's compact stand-in blocks (`kvlab.prefix.trace_blocks.TraceBlocks`) against the
per-token stand-in ids they replace: the same block contents block by block, and the same serving
decisions (hits, admissions, preemptions, first-token and finish times) on real Mooncake slices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.config import load_config
from kvlab.serving import (CostModel, Request, SchedulerConfig, SimulatedExecutor, get_card,
                           serve, simulated_manager, speed_up)
from kvlab.prefix import PrefixCachingKVCacheManager, trace_blocks
from kvlab.prefix.trace_blocks import TraceBlocks
from kvlab.workload import from_sizes, shrink
from kvlab.traces import load_trace
from kvlab.sizing import kv_bytes_per_token


def ids_of_runs(content: tuple[int, ...]) -> list[int]:
    """The ids a content stands for: (first, length) runs, ascending for trace ids (>= 0), the
    request's own id (< 0) repeated."""
    ids: list[int] = []
    for first, length in zip(content[::2], content[1::2]):
        ids += range(first, first + length) if first >= 0 else [first] * length
    return ids


@st.composite
def simulated_requests(draw, request_id: int) -> Request:
    """A small request with trace block ids from a tiny alphabet (so that pairs share blocks),
    sometimes consecutive ids (runs that continue across trace blocks), sometimes none."""
    trace_block_size = draw(st.integers(1, 8))
    prompt_len = draw(st.integers(1, 60))
    num_named = draw(st.integers(0, -(-prompt_len // trace_block_size)))
    trace_ids = tuple(draw(st.lists(st.integers(0, 4), min_size=num_named, max_size=num_named)))
    request = Request(request_id, 0.0, prompt_len, 20, trace_block_ids=trace_ids,
                      trace_block_size=trace_block_size if trace_ids else 0)
    request.num_output_tokens = draw(st.integers(0, 19))
    return request


@settings(max_examples=300, deadline=None)
@given(a=simulated_requests(0), b=simulated_requests(1), block_size=st.integers(1, 12))
def test_block_contents_are_equal_exactly_when_stand_in_ids_are(a, b, block_size):
    blocks_a, blocks_b = TraceBlocks(a), TraceBlocks(b)
    ids_a = trace_blocks.token_ids(a, 0, a.num_tokens)
    ids_b = trace_blocks.token_ids(b, 0, b.num_tokens)
    for index in range(min(a.num_tokens, b.num_tokens) // block_size):
        window = slice(index * block_size, (index + 1) * block_size)
        content_a, content_b = blocks_a.block(index, block_size), blocks_b.block(index, block_size)
        assert ids_of_runs(content_a) == ids_a[window]
        assert ids_of_runs(content_b) == ids_b[window]
        assert (content_a == content_b) == (ids_a[window] == ids_b[window])
    # the same request after a preemption: equal contents, block for block
    again = TraceBlocks(a)
    assert all(again.block(i, block_size) == blocks_a.block(i, block_size)
               for i in range(a.num_tokens // block_size))


def test_a_block_inside_one_trace_block_is_one_run_and_consecutive_ids_merge():
    request = Request(5, 0.0, 1100, 4, trace_block_ids=(7, 8, 3), trace_block_size=512)
    blocks = TraceBlocks(request)
    assert blocks.block(1, 16) == (7 * 512 + 16, 16)
    assert blocks.block(0, 1024) == (7 * 512, 1024)                     # 7 then 8: one run
    request.num_output_tokens = 4   # trace block 8 from token 40, block 3, then 4 output tokens
    assert TraceBlocks(request).block(1, 552) == (8 * 512 + 40, 472, 3 * 512, 76, -6, 4)


def test_a_simulated_request_grows_only_by_its_own_output_ids():
    request = Request(2, 0.0, 40, 3, trace_block_ids=(1,), trace_block_size=32)
    blocks = TraceBlocks(request)
    blocks.extend([-3, -3])
    assert len(blocks) == 42 and blocks.block(5, 7) == (-3, 7)
    with pytest.raises(ValueError, match="own id -3"):
        blocks.extend([7])
    with pytest.raises(ValueError, match="trace block ids must be >= 0"):
        TraceBlocks(Request(0, 0.0, 8, 1, trace_block_ids=(-1,), trace_block_size=8))


def test_model_mode_requests_keep_their_real_ids():
    request = Request(0, 0.0, 5, 2, prompt_token_ids=[9, 8, 7, 6, 5])
    assert trace_blocks.block_tokens(request) == [9, 8, 7, 6, 5]
    assert isinstance(trace_blocks.block_tokens(Request(1, 0.0, 5, 2)), TraceBlocks)


def decisions(result):
    return [(r.request_id, r.state, r.first_token_s, r.finish_s, r.num_preemptions,
             r.num_cached_tokens) for r in sorted(result.served_requests,
                                                   key=lambda r: r.request_id)]


# (lengths divided by, block_size, KV budget in tokens, max_model_len): trace blocks of 64 tokens
# holding 4 cache blocks; trace blocks of 8 tokens with cache blocks of 12 straddling them
SLICES = [(8, 16, 2600, 2048), (64, 12, 2000, 1024)]


@pytest.mark.parametrize("shrink_by, block_size, budget_tokens, max_model_len", SLICES)
def test_replay_makes_the_decisions_of_per_token_stand_in_ids(monkeypatch, shrink_by, block_size,
                                                              budget_tokens, max_model_len):
    config = load_config("llama-3.1-70b")
    cost = CostModel(config, get_card("H100-80GB"), tp=4, dtype="bf16")
    per_token = kv_bytes_per_token(config, "bf16", 4)
    rows = load_trace("mooncake-conversation", limit=300)
    requests = speed_up(shrink(from_sizes(rows), shrink_by), 100)
    scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024)

    def replay():
        kv = simulated_manager("prefix", budget_tokens * per_token, per_token, max_model_len,
                               block_size)
        result = serve(requests, kv, SimulatedExecutor(cost), scheduler, per_token,
                       progress=False)
        return result, kv.prefix_stats

    fast, fast_stats = replay()
    # the reference: the stand-in ids built token by token and hashed with SHA-256
    monkeypatch.setattr(trace_blocks, "block_tokens",
                        lambda request: trace_blocks.token_ids(request, 0, request.num_tokens))
    reference, reference_stats = replay()

    assert decisions(fast) == decisions(reference)
    assert fast.series.reserved_tokens == reference.series.reserved_tokens
    assert fast.series.running == reference.series.running
    assert (fast.preemptions, fast.prefix_hit_rate, fast.readmitted_hit_rate) == (
        reference.preemptions, reference.prefix_hit_rate, reference.readmitted_hit_rate)
    assert fast_stats == reference_stats
    # the slice exercises what it claims to: hits (at 64 times shorter, only re-admissions'),
    # evictions, preemptions
    assert fast_stats.prefill_tokens_skipped > 0 and fast_stats.num_evictions > 0
    assert fast.preemptions > 0


def test_simulation_retries_the_queue_head_without_rehashing(monkeypatch):
    calls = []  # one entry per block hashed (block_hash hashes through chain_hashes)
    chain_hashes = TraceBlocks.chain_hashes

    def counting(self, parent_hash, contents, *args):
        calls.extend(contents)
        return chain_hashes(self, parent_hash, contents, *args)

    monkeypatch.setattr(TraceBlocks, "chain_hashes", counting)
    kv = PrefixCachingKVCacheManager(7, 16, 112)

    def admit(request):  # the scheduler's admission; -> tokens found cached, or None
        blocks, cached = kv.get_computed_blocks(request)
        new = kv.allocate_slots(request, request.num_tokens - cached, cached, blocks)
        return None if new is None else cached

    first = Request(0, 0.0, 80, 4, trace_block_ids=(3, 4), trace_block_size=32)
    head = Request(1, 0.0, 100, 4, trace_block_ids=(3, 4), trace_block_size=32)
    assert admit(first) == 0                         # 5 blocks, 5 hashed
    assert admit(head) is None                       # 4 hits + 3 new > 2 free
    assert len(calls) == 10                          # blocks 0-3 hit, block 4 missed
    for _ in range(5):
        assert admit(head) is None                   # every retry: no hashing
    assert len(calls) == 10
    kv.free(first)
    assert admit(head) == 64                         # 64 shared tokens hit; block 5 new
    assert len(calls) == 11


def test_simulated_forks_take_per_token_stand_ins_and_decide_alike(monkeypatch):
    """A request for n > 1 completions without ids: its forks inherit the parent's record and
    append outputs under their own ids, so it is admitted with per-token stand-ins."""
    cost = CostModel(load_config("llama-3.1-70b"), get_card("H100-80GB"), tp=4, dtype="bf16")

    def replay():
        requests = []
        for parent_id in range(0, 12, 3):
            family = [Request(parent_id + i, 0.01 * parent_id, 70, 9, trace_block_ids=(1, 2, 3),
                              trace_block_size=32) for i in range(3)]
            family[0].forks = family[1:]
            requests.append(family[0])
        return serve(requests, simulated_manager("prefix", 24 * 16 * 100, 100, 128, 16),
                     SimulatedExecutor(cost), SchedulerConfig(8, 64), 100, progress=False)

    fast = replay()
    monkeypatch.setattr(trace_blocks, "block_tokens",
                        lambda request: trace_blocks.token_ids(request, 0, request.num_tokens))
    reference = replay()
    assert decisions(fast) == decisions(reference)
    assert fast.row()["finished"] == 12 and fast.preemptions == reference.preemptions


def test_a_refused_admission_retry_finds_what_a_fresh_lookup_finds(monkeypatch):
    """The manager keeps a refused admission's hits and on the retry only checks they are still
    cached; replaying with that shortcut disabled must decide exactly alike."""
    config = load_config("llama-3.1-70b")
    cost = CostModel(config, get_card("H100-80GB"), tp=4, dtype="bf16")
    per_token = kv_bytes_per_token(config, "bf16", 4)
    requests = speed_up(shrink(from_sizes(load_trace("mooncake-conversation", limit=300)), 8), 100)
    scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024)

    def replay():
        kv = simulated_manager("prefix", 2600 * per_token, per_token, 2048, 16)
        return (serve(requests, kv, SimulatedExecutor(cost), scheduler, per_token,
                      progress=False), kv.prefix_stats)

    remembered = PrefixCachingKVCacheManager._last_lookup
    reused = []

    def counting(self, request):
        known = remembered(self, request)
        reused.append(len(known[2]))
        return known

    monkeypatch.setattr(PrefixCachingKVCacheManager, "_last_lookup", counting)
    shortcut, shortcut_stats = replay()
    assert sum(reused) > 0  # retries did start from remembered hits
    monkeypatch.setattr(PrefixCachingKVCacheManager, "_last_lookup",
                        lambda self, request: remembered(self, request)[:2] + ([],))
    full, full_stats = replay()
    assert decisions(shortcut) == decisions(full)
    assert shortcut.series.reserved_tokens == full.series.reserved_tokens
    assert shortcut_stats == full_stats
