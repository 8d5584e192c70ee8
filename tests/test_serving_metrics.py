"""Stage 7's figures pinned where a change went unnoticed before: TTFT from arrival, times at the
end of the step that produced them, p99 and p50 as percentiles (not the max or the mean), causal
attention pairs in a chunked prefill, KV usage from what is reserved, token states with a shared
slot counted once, prefix hits at first admissions apart from re-admissions (as vLLM counts)."""

from __future__ import annotations

import pytest

from kvlab.config import load_config
from kvlab.serving import (CostModel, Request, SchedulerConfig, StepSeries, format_rows, get_card,
                           percentile, serve, simulated_manager)
from kvlab.serving.metrics import summarize


class UnitClock:
    """Every step takes exactly 1 s, so each time below can be worked out by hand."""

    def execute(self, output):
        return None, 1.0

    def release(self, request):
        pass


def by_id(result):
    return {r.request_id: r for r in result.served_requests}


def one_at_a_time():
    """Request 0 (0 s, 4 + 3 tokens) runs alone; request 1 (arrives 0.5 s, 4 + 2) waits for it."""
    requests = [Request(0, 0.0, 4, 3), Request(1, 0.5, 4, 2)]
    kv = simulated_manager("paged", 64 * 100, 100, max_model_len=32, block_size=4)
    return serve(requests, kv, UnitClock(), SchedulerConfig(max_num_seqs=1))


def test_first_token_and_finish_times_are_at_the_end_of_the_step_that_produced_them():
    # Step [0, 1] prefills request 0: its first token exists at 1 s, not 0 s. Steps [1, 2] and
    # [2, 3] decode its other two: it finishes at 3 s. Request 1 is admitted at 3 s: [3, 4] is its
    # prefill (first token 4 s), [4, 5] its last token (finish 5 s).
    served = by_id(one_at_a_time())
    assert (served[0].first_token_s, served[0].finish_s) == (1.0, 3.0)
    assert (served[1].first_token_s, served[1].finish_s) == (4.0, 5.0)


def test_ttft_is_measured_from_arrival_not_admission():
    # Request 1 arrived at 0.5 s and was admitted at 3 s: it waited 2.5 s, then 1 s to prefill.
    result = one_at_a_time()
    ttft = [1.0 - 0.0, 4.0 - 0.5]   # from admission it would be [1, 1]
    assert result.ttft_p50_s == pytest.approx(percentile(ttft, 50)) == pytest.approx(2.25)
    assert result.duration_s == 5.0   # last finish - first arrival


def finished(request_id, arrival_s, first_token_s, finish_s, output_tokens):
    request = Request(request_id, arrival_s, 8, output_tokens)
    request.first_token_s, request.finish_s = first_token_s, finish_s
    request.num_output_tokens = output_tokens
    return request


def summary(requests):
    return summarize("test", requests, StepSeries(), 0, 0, None, 0, 1, 1, 1.0, 0)


def test_p99_is_the_99th_percentile_not_the_max():
    # TTFTs 0.1, 0.2, 0.3, 10 s: the 99th percentile lies between the two largest (numpy's linear
    # rule: 0.3 + 0.97 x 9.7 = 9.709 s), below the 10 s maximum.
    requests = [finished(i, 0.0, ttft, ttft + 1.0, 2) for i, ttft in enumerate((0.1, 0.2, 0.3, 10))]
    result = summary(requests)
    assert result.ttft_p99_s == pytest.approx(9.709)
    assert result.ttft_p99_s < 10.0


def test_tpot_p50_is_the_median_not_the_mean():
    # TPOT = (finish - first token) / (output tokens - 1): 1, 1, 1 and 100 ms. The median is 1 ms;
    # the mean would be 25.75 ms. A one-token request has no TPOT and is left out.
    requests = [finished(i, 0.0, 1.0, 1.0 + 10 * tpot, 11)
                for i, tpot in enumerate((0.001, 0.001, 0.001, 0.1))]
    requests.append(finished(4, 0.0, 1.0, 1.0, 1))
    result = summary(requests)
    assert result.tpot_p50_s == pytest.approx(0.001)
    assert result.tpot_p99_s == pytest.approx(0.001 + 0.97 * 0.099)


def test_causal_attention_pairs_of_a_chunked_prefill():
    # A chunk of n = 2,048 tokens after c = 6,144 computed ones: each new token attends to the c
    # cached ones and to the new ones up to itself, n x c + n (n + 1) / 2 (query, key) pairs.
    config = load_config("llama-3.1-70b")
    cost = CostModel(config, get_card("H100-80GB"), tp=4, dtype="bf16")
    request = Request(0, 0.0, 8192, 1)
    request.num_computed_tokens = 6144
    n, c = 2048, 6144
    pairs = n * c + n * (n + 1) // 2
    # the chunk ends the prompt, so its last row samples: the LM head runs once
    flops = (2 * cost.layer_params * n + 2 * cost.lm_head_params
             + 4 * 80 * (64 // 4) * 128 * pairs)  # compute-bound
    assert cost.step_time_of([(request, n)]) == pytest.approx(flops / 989e12, rel=1e-9)
    # Decode (n = 1) attends to every cached token and itself: c + 1 pairs, c keys read.
    decode = cost.step_time_of([(request, 1)])
    assert decode == pytest.approx(cost.step_time(1, c, c + 1, 0), rel=1e-12)


def test_the_lm_head_runs_on_sampled_rows_only():
    # Llama-3.1-8B: untied embedding and LM head, 128,256 x 4,096 each; neither multiplies a
    # token that does not sample (the embedding is a lookup).
    config = load_config("llama-3.1-8b")
    cost = CostModel(config, get_card("H100-80GB"), tp=2, dtype="bf16")
    head = 128256 * 4096 // 2
    assert cost.lm_head_params == head
    assert cost.layer_params == cost.weights_bytes // 2 - 2 * head
    # A 1,000-token prompt in two chunks: the first samples nothing, the second one row.
    request = Request(0, 0.0, 1000, 4)
    assert CostModel.step_sizes([(request, 600)]) == (600, 0, 600 * 601 // 2, 0)
    request.num_computed_tokens = 600
    assert CostModel.step_sizes([(request, 400)])[3] == 1
    _, one = cost.step_work(400, 600, 0, 1)
    _, none = cost.step_work(400, 600, 0, 0)
    assert one - none == 2 * head
    # Tied (SmolLM2): the one matrix is the LM head, counted once.
    tied = CostModel(load_config("smollm2-135m"), get_card("H100-80GB"), dtype="fp32")
    assert tied.layer_params + tied.lm_head_params == tied.weights_bytes // 4


@pytest.mark.parametrize("strategy, expected", [
    # 2 slabs of max_model_len 64: a 5-token prompt holds one whole slab, half the budget
    ("contiguous", 64 / 128),
    # 32 blocks of 4 tokens: a 5-token prompt takes 2 blocks (8 slots) of 128
    ("paged", 8 / 128)])
def test_kv_usage_is_what_is_reserved_not_what_holds_tokens(strategy, expected):
    kv = simulated_manager(strategy, 128 * 100, 100, max_model_len=64, block_size=4)
    result = serve([Request(0, 0.0, 5, 1)], kv, UnitClock())   # one step: prefill, one token
    assert result.capacity_tokens == 128
    assert result.kv_usage_peak == pytest.approx(expected)
    assert result.kv_usage_mean == pytest.approx(expected)  # the request holds it every step
    assert result.series.used_tokens == [5] and result.series.reserved_tokens == [128 * expected]


@pytest.mark.parametrize("strategy, expected", [("contiguous", 5 / 64), ("paged", 5 / 8)])
def test_token_states_share_is_states_over_what_is_reserved(strategy, expected):
    # The vLLM paper's measure: the 5 prompt tokens' K/V in the one slab (64) or 2 blocks (8).
    kv = simulated_manager(strategy, 128 * 100, 100, max_model_len=64, block_size=4)
    assert serve([Request(0, 0.0, 5, 1)], kv, UnitClock()).kv_states_share == pytest.approx(expected)


def test_token_states_share_time_weights_the_steps():
    # Request 0 of `one_at_a_time` holds 1 block (4 slots) for its 4-token prefill, then 2 blocks
    # for its 2 decode steps, with 4, 5, 6 token states: (4 + 5 + 6) x 1 s over (4 + 8 + 8) x 1 s,
    # and request 1 the same minus its last step: (4 + 5) over (4 + 8).
    assert one_at_a_time().kv_states_share == pytest.approx((15 + 9) / (20 + 12))


def test_figure_2_reservations_order_as_in_the_paper():
    from kvlab.tools.calibration.token_states import RESERVATIONS, token_state_shares

    config = load_config("llama-3.1-8b")
    cost = CostModel(config, get_card("H100-80GB"))
    requests = [Request(i, 0.05 * i, 50 + 37 * i % 400, 1 + 13 * i % 90) for i in range(60)]
    results = token_state_shares(requests, cost, 4096 * 20 * cost.kv_bytes_per_token, 1024)
    shares = [results[name].kv_states_share for name in RESERVATIONS]
    assert list(results) == list(RESERVATIONS) and all(r.finished == 60 for r in results.values())
    assert shares == sorted(shares) and shares[0] < 0.5 < shares[-1] <= 1.0


# ---- prefix cache hits, counted as vLLM counts them; a shared slot counted once ----------------

def sharing_requests():
    """24 requests sharing a 32-token prefix (trace blocks 1, 2 of 16 tokens), every sixth with a
    fork (n = 2): in a pool of 40 blocks of 16 they share blocks, fork, preempt and finish."""
    requests = []
    for i in range(24):
        request = Request(i, 0.01 * i, 20 + 37 * (i % 5), 10 + 23 * (i % 3),
                          trace_block_ids=(1, 2, 100 + i), trace_block_size=16)
        if i % 6 == 0:
            request.forks = [Request(1000 + i, 0.01 * i, request.prompt_len, 12)]
        requests.append(request)
    return requests


@pytest.mark.parametrize("strategy", ["paged", "prefix"])
def test_token_states_count_a_shared_slot_once(strategy):
    # Each step's token states against the manager's own count of distinct slots holding data
    # (`num_stored_tokens`, block by block), read at the same moment (after the decision): a
    # prefix block or a fork's block held by several requests is one slot each, as in what is
    # reserved, so states never exceed what is reserved. The plain paged pool shares blocks too,
    # between a request and its forks (n = 2).
    import collections

    from kvlab.serving import Scheduler, SimulatedExecutor, engine_step
    from kvlab.serving.engine_core import replay

    requests = sharing_requests()
    kv = simulated_manager(strategy, 40 * 16 * 100, 100, max_model_len=512, block_size=16)
    scheduler = Scheduler(kv, SchedulerConfig(8, 128))
    executor = SimulatedExecutor(CostModel(load_config("llama-3.1-8b"), get_card("H100-80GB")))
    stored = []

    def record(output):
        if output.scheduled:  # the steps the series records
            stored.append(kv.num_stored_tokens)

    pending = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
    served = [member for request in pending for member in (request, *request.forks)]
    result = replay(pending, served, scheduler,
                    lambda now: engine_step(scheduler, executor, now, on_scheduled=record))
    assert result.preemptions > 0 and result.finished == 28
    assert (result.prefix_hit_tokens or 0) > 0 or strategy == "paged"
    assert kv.num_cow_copies > 0  # forks shared a partly filled block, then copied it
    assert result.series.used_tokens == stored
    assert all(used <= reserved for used, reserved in zip(result.series.used_tokens,
                                                          result.series.reserved_tokens))
    assert kv.num_shared_tokens == 0  # every request freed: nothing shared is left


def test_token_states_stay_within_what_is_reserved_on_mooncake():
    # Notebook 07's Mooncake replay (the first 750 requests of the conversation trace, arrivals
    # 2x faster, Llama-3.1-70B on 4 x H100-80GB at vLLM's budgets) read 105.6 % when a shared
    # prefix block counted once for each request holding it.
    from kvlab.lazy_decode import serve as lazy_serve
    from kvlab.serving import SimulatedExecutor, from_sizes, speed_up
    from kvlab.sizing import kv_bytes_per_token, weights_bytes
    from kvlab.traces import load_trace

    config, card = load_config("llama-3.1-70b"), get_card("H100-80GB")
    per_token = kv_bytes_per_token(config, "bf16", 4)
    budget = int(0.9 * card.memory_bytes) - weights_bytes(config, "bf16", 4)
    requests = speed_up(from_sizes(load_trace("mooncake-conversation", limit=750)), 2)
    result = lazy_serve(requests, simulated_manager("prefix", budget, per_token, 32768),
                        SimulatedExecutor(CostModel(config, card, tp=4)),
                        SchedulerConfig(1024, 8192), per_token, progress=False)
    assert result.prefix_hit_rate > 0.05 and result.preemptions > 0
    assert 0.99 < result.kv_states_share <= 1.0
    assert all(used <= reserved for used, reserved in zip(result.series.used_tokens,
                                                          result.series.reserved_tokens))


def test_without_shared_prefixes_only_readmissions_hit():
    # Azure-like requests carry no prefix ids: no two share a block. In a pool of 24 blocks of 16
    # they preempt one another, and a request back after a preemption finds its own blocks, still
    # cached since they were freed. vLLM leaves those hits out of its hit rate, and so does kvlab:
    # 0 at first admissions, the re-admissions' apart.
    requests = [Request(i, 0.02 * i, 60 + 29 * (i % 4), 40 + 17 * (i % 3)) for i in range(16)]
    kv = simulated_manager("prefix", 24 * 16 * 100, 100, max_model_len=384, block_size=16)
    result = serve(requests, kv, UnitClock(), SchedulerConfig(8, 256))
    assert result.finished == 16 and result.preemptions > 0
    assert (result.prefix_hit_rate, result.prefix_hit_tokens) == (0.0, 0)
    assert result.prefix_queried_tokens == sum(r.prompt_len for r in requests)  # once each
    assert 0 < result.readmitted_hit_tokens <= result.readmitted_queried_tokens
    assert result.readmitted_hit_rate == pytest.approx(
        result.readmitted_hit_tokens / result.readmitted_queried_tokens)
    stats = kv.prefix_stats  # the manager counts as the scheduler does
    assert (stats.num_lookups, stats.num_hit_tokens, stats.hit_rate) == (16, 0, 0.0)
    assert stats.num_readmitted_lookups == sum(r.num_preemptions for r in result.served_requests)
    assert (stats.num_readmitted_query_tokens, stats.num_readmitted_hit_tokens) == (
        result.readmitted_queried_tokens, result.readmitted_hit_tokens)
    assert stats.prefill_tokens_skipped == result.readmitted_hit_tokens
    row = result.row()
    assert (row["prefix_hit_rate"], row["readmitted_hit_tokens"]) == (0.0,
                                                                      result.readmitted_hit_tokens)
    header, _, line = format_rows([result]).splitlines()
    assert header.split()[-4:] == ["prefix", "hit", "re-admit", "hit"]
    assert line.split()[-2:] == ["0.0%", f"{result.readmitted_hit_rate:.1%}"]


def test_shared_prefix_hits_at_first_admission():
    # 4 requests of 80 tokens whose first 64 are the same two trace blocks: each after the first
    # finds those 4 blocks of 16 cached, in a pool that holds them all (nothing is preempted).
    requests = [Request(i, 0.1 * i, 80, 4, trace_block_ids=(7, 8, 100 + i), trace_block_size=32)
                for i in range(4)]
    kv = simulated_manager("prefix", 64 * 16 * 100, 100, max_model_len=128, block_size=16)
    result = serve(requests, kv, UnitClock(), SchedulerConfig(8, 256))
    assert result.preemptions == 0
    assert (result.prefix_hit_tokens, result.prefix_queried_tokens) == (3 * 64, 4 * 80)
    assert result.prefix_hit_rate == pytest.approx(0.6)
    assert (result.readmitted_hit_tokens, result.readmitted_hit_rate) == (0, None)
