"""kvlab.workload: the synthetic Azure-fit traffic, its statistics, and where it parts from the trace."""

from __future__ import annotations

import math
import statistics

import pytest

from kvlab.traces import azure_trace
from kvlab.workload import (AZURE_CONV_2023, SHAREGPT, LogNormalFit, Request, compare_to_trace,
                            percentile, share_longer_than, synthetic_requests, traffic_stats)


def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def capped_lognormal_mean(mean: float, median: float, cap: float) -> float:
    """E[min(X, cap)] for the log-normal with this mean and median (closed form):
    E[X; X < c] + c P(X >= c) = e^(mu + s^2/2) Phi((ln c - mu - s^2) / s) + c (1 - Phi((ln c - mu) / s))."""
    mu, s = math.log(median), math.sqrt(2.0 * math.log(mean / median))
    log_cap = math.log(cap)
    return mean * normal_cdf((log_cap - mu - s * s) / s) + cap * (1.0 - normal_cdf((log_cap - mu) / s))


# ---- synthetic traffic -----------------------------------------------------------------------

def test_same_seed_same_requests_other_seed_different():
    first = synthetic_requests(200, seed=42)
    assert first == synthetic_requests(200, seed=42)
    assert first != synthetic_requests(200, seed=43)
    assert synthetic_requests(50, seed=42) == first[:50]  # a prefix of the longer draw


def test_fit_parameters_by_hand():
    # mu = ln(median), sigma = sqrt(2 ln(mean / median)); the module documents the rounded values.
    mu, sigma = LogNormalFit.mu_sigma(1155, 1020)
    assert mu == pytest.approx(math.log(1020)) and round(mu, 3) == 6.928 and round(sigma, 3) == 0.499
    mu, sigma = LogNormalFit.mu_sigma(211, 129)
    assert round(mu, 3) == 4.860 and round(sigma, 3) == 0.992
    # The fitted distribution has the published mean back: e^(mu + sigma^2 / 2).
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(211)


def test_20k_draws_match_the_published_azure_statistics():
    """Medians within 2 % (sample-median standard errors: ~4.5 and ~1.1 tokens, so >= 4 sigma);
    prompt mean within 2 % of 1,155 (SE ~4.3 tokens); output mean within 2 % of the capped
    log-normal mean (the 1,000-token cap takes it from 211 to 200.6)."""
    requests = synthetic_requests(20_000, seed=0)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert len(requests) == 20_000
    assert abs(statistics.median(prompts) - 1020) <= 0.02 * 1020
    assert abs(statistics.median(outputs) - 129) <= 0.02 * 129 + 0.5
    assert abs(statistics.mean(prompts) - 1155) <= 0.02 * 1155
    expected_output_mean = capped_lognormal_mean(211, 129, 1000)
    assert expected_output_mean == pytest.approx(200.6, abs=0.1)
    assert abs(statistics.mean(outputs) - expected_output_mean) <= 0.02 * expected_output_mean
    assert min(prompts) >= 1 and min(outputs) >= 1
    assert max(outputs) == 1000  # the cap binds (P(X > 1000) ~ 2 %: ~400 of 20k draws)
    assert all(r.arrival_s == 0.0 for r in requests)


def test_sharegpt_means():
    """ShareGPT preset (no cap): means 161 / 338 within 3 % (SE ~0.6 / ~3 tokens)."""
    requests = synthetic_requests(20_000, SHAREGPT, seed=1)
    assert abs(statistics.mean(r.prompt_len for r in requests) - 161) <= 0.03 * 161
    assert abs(statistics.mean(r.output_len for r in requests) - 338) <= 0.03 * 338


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_num_requests_must_be_positive_int(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        synthetic_requests(bad)


def test_request_total_len():
    assert Request(10, 5).total_len == 15
    assert Request(3, 0).total_len == 3


# ---- statistics, and what the fit does not match ------------------------------------------

def test_percentile_linear_by_hand():
    """Rank (n - 1) q / 100, interpolated between its neighbours (numpy's default method)."""
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7], 99) == 7
    for bad_q in (-5, 101):
        with pytest.raises(ValueError, match="q"):
            percentile([1, 2], bad_q)
    assert math.isnan(percentile([], 50))


def test_share_longer_than_by_hand():
    requests = [Request(10, 5), Request(4000, 96), Request(4000, 97), Request(1, 0)]
    assert share_longer_than(requests, 4096) == 1 / 4  # 4,096 exactly is not longer
    assert share_longer_than(requests, 14) == 3 / 4
    with pytest.raises(ValueError):
        share_longer_than([], 4096)


def test_traffic_stats_by_hand():
    stats = traffic_stats([Request(10, 1), Request(20, 3), Request(30, 5), Request(40, 7)],
                          thresholds=(25, 50))
    assert stats.num_requests == 4
    assert (stats.prompt_mean, stats.prompt_median) == (25, 25)
    assert stats.prompt_p99 == pytest.approx(39.7)  # 30 + 0.97 x (40 - 30)
    assert (stats.output_mean, stats.output_median) == (4, 4)
    assert stats.output_p99 == pytest.approx(6.94)
    assert stats.share_longer_than == {25: 0.5, 50: 0.0}


def test_fit_matches_the_trace_centre_but_not_its_tail():
    """The fit reproduces mean and median but has a far thinner tail than the real trace. The
    README quotes these figures ("0.4 % vs 8.3 %", "3,280 vs 4,142"); they are computed here."""
    trace, fit = compare_to_trace(azure_trace("conv"))
    assert trace.num_requests == fit.num_requests == 19_366
    # The centre matches (within 2 %): the fit was made from these four numbers.
    assert abs(fit.prompt_median - trace.prompt_median) <= 0.02 * trace.prompt_median
    assert abs(fit.prompt_mean - trace.prompt_mean) <= 0.02 * trace.prompt_mean
    assert abs(fit.output_median - trace.output_median) <= 0.02 * trace.output_median + 1
    # The tail does not: 20 x fewer requests over 4,096 tokens, a lower prompt p99.
    assert round(100 * trace.share_longer_than[4096], 1) == 8.3
    assert round(100 * fit.share_longer_than[4096], 1) == 0.4
    assert (trace.prompt_p99, round(fit.prompt_p99)) == (4142, 3280)
    # ... while the fit's output tail is heavier (the log-normal piles up at the 1,000 cap).
    assert (trace.output_p99, fit.output_p99) == (601, 1000)
