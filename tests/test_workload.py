"""kvlab.workload: the synthetic Azure-fit traffic and the Azure trace CSV loader."""

from __future__ import annotations

import math
import statistics

import pytest

from kvlab.workload import (AZURE_CONV_2023, SHAREGPT, LogNormalFit, Request, TraceFormatError,
                            load_azure_trace, synthetic_requests)


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


# ---- Azure trace CSV -------------------------------------------------------------------------

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_trace(tmp_path, body: str, header: str = HEADER):
    path = tmp_path / "trace.csv"
    path.write_text(header + body)
    return path


def test_load_trace_in_file_order_with_arrivals(tmp_path):
    path = write_trace(tmp_path, "2023-11-16 18:15:46.6805900,374,44\n"
                                 "2023-11-16 18:15:50.9951690,396,109\n"
                                 "2023-11-16 18:16:46.6805900,879,0\n")
    requests = load_azure_trace(path)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(374, 44), (396, 109), (879, 0)]
    assert requests[0].arrival_s == 0.0
    assert requests[1].arrival_s == pytest.approx(50.995169 - 46.68059, abs=1e-6)
    assert requests[2].arrival_s == pytest.approx(60.0, abs=1e-6)
    assert load_azure_trace(str(path), limit=2) == requests[:2]


def test_limit_is_never_exceeded(tmp_path):
    path = write_trace(tmp_path, "t,5,6\nt,7,8\nt,9,10\n")
    assert len(load_azure_trace(path, limit=1)) == 1
    assert len(load_azure_trace(path, limit=10)) == 3
    try:
        none = load_azure_trace(path, limit=0)
    except ValueError:
        return  # refusing limit=0 is as good as reading nothing
    assert none == []


def test_unparseable_timestamps_give_zero_arrival(tmp_path):
    requests = load_azure_trace(write_trace(tmp_path, "yesterday,5,6\n,7,8\n"))
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in requests] == [(5, 6, 0.0),
                                                                             (7, 8, 0.0)]


def test_columns_in_any_order_and_spaces(tmp_path):
    path = write_trace(tmp_path, "12, 3,t\n", header="ContextTokens,GeneratedTokens,TIMESTAMP\n")
    assert load_azure_trace(path) == [Request(12, 3)]


@pytest.mark.parametrize("row, line, fragments", [
    ("t,abc,5", 3, ["ContextTokens", "'abc'"]),
    ("t,12,4.5", 3, ["GeneratedTokens", "'4.5'"]),
    ("t,-7,5", 3, ["ContextTokens", "-7"]),
    ("t,0,5", 3, ["ContextTokens", "0", ">= 1"]),
    ("t,10,-1", 3, ["GeneratedTokens", "-1"]),
    ("t,10", 3, ["GeneratedTokens", "None"]),  # a missing column in the row
])
def test_malformed_rows_name_line_and_value(tmp_path, row, line, fragments):
    path = write_trace(tmp_path, f"t,5,6\n{row}\nt,7,8\n")
    with pytest.raises(TraceFormatError) as info:
        load_azure_trace(path)
    message = str(info.value)
    assert f"trace.csv:{line}" in message
    for fragment in fragments:
        assert fragment in message, fragment
    assert isinstance(info.value, ValueError)


def test_header_missing_a_column(tmp_path):
    path = write_trace(tmp_path, "t,5\n", header="TIMESTAMP,ContextTokens\n")
    with pytest.raises(TraceFormatError, match="GeneratedTokens"):
        load_azure_trace(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_azure_trace(tmp_path / "nope.csv")
