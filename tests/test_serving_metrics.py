"""Stage 7's figures pinned where a change went unnoticed before: TTFT from arrival, times at the
end of the step that produced them, p99 and p50 as percentiles (not the max or the mean), causal
attention pairs in a chunked prefill, KV usage from what is reserved."""

from __future__ import annotations

import pytest

from kvlab.config import load_config
from kvlab.serving import (CostModel, Request, SchedulerConfig, StepSeries, get_card, percentile,
                           serve, simulated_manager)
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
