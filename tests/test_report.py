"""kvlab.report: reserved vs used KV memory on traffic, checked by hand and by brute force."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.report import (ContiguousStrategy, PagedStrategy, decode_steps, format_report,
                          held_token_steps, replay)
from kvlab.workload import Request, synthetic_requests


def brute_force(requests, max_model_len):
    """Step through every request: at step i it holds P + i tokens, i < max(G, 1) (the engine
    never writes the last generated token's K/V; tests/test_lifetime.py checks that against the
    paged engine) and reserves a whole max_model_len slab. Returns (steps, held, reserved)."""
    steps = held = reserved = 0
    for r in requests:
        if r.prompt_len + r.output_len > max_model_len:
            continue
        lifetime = [r.prompt_len + i for i in range(max(r.output_len, 1))]
        steps += len(lifetime)
        held += sum(lifetime)
        reserved += len(lifetime) * max_model_len
    return steps, held, reserved


def test_two_requests_by_hand():
    """max_model_len 8, 100 B per token, budget 2,000 B.

    A: P=3, G=2 -> 2 steps holding 3 and 4 tokens; B: P=2, G=0 -> 1 step holding 2 tokens;
    C: P=6, G=5 -> 11 > 8 tokens: rejected.
    steps 3, held 3 + 4 + 2 = 9 token-steps, reserved 3 x 8 = 24 token-steps.
    """
    requests = [Request(3, 2), Request(2, 0), Request(6, 5)]
    report = replay(requests, [ContiguousStrategy(max_model_len=8, bytes_per_token=100)],
                    max_model_len=8, kv_budget_bytes=2000, workload="hand", model="toy")
    assert (report.num_requests, report.served, report.rejected) == (3, 2, 1)
    assert report.rejected_examples == [{"prompt_len": 6, "output_len": 5, "total_len": 11}]
    (row,) = report.rows
    assert row.strategy == "contiguous" and row.kv_bytes_per_token == 100
    assert row.waste == pytest.approx(1 - 9 / 24)  # 62.5 %
    assert row.kv_reserved_bytes == 24 * 100 // 3 == 800  # one 8-token slab
    assert row.kv_used_bytes == 9 * 100 // 3 == 300
    assert row.requests_held == 2000 // 800 == 2
    assert row.requests_held_exact  # every request reserves the same slab
    assert (report.max_model_len, report.kv_budget_bytes) == (8, 2000)
    assert report.workload == "hand" and report.model == "toy"
    assert report.as_dict()["rows"][0] == dataclasses.asdict(row)


def test_request_exactly_max_model_len_is_served():
    report = replay([Request(5, 3)], [ContiguousStrategy(8, 1)], max_model_len=8,
                    kv_budget_bytes=8)
    assert report.served == 1 and report.rejected == 0
    # Holds 5, 6, 7 of 8 slots: waste = 1 - 18 / 24.
    assert report.rows[0].waste == pytest.approx(6 / 24)
    assert report.rows[0].requests_held == 1


def test_several_strategies_each_get_a_row():
    requests = [Request(3, 2), Request(2, 0)]
    strategies = [ContiguousStrategy(8, 100, name="slab-8"),
                  ContiguousStrategy(16, 100, name="slab-16"),
                  ContiguousStrategy(8, 50, name="slab-8-fp8")]
    report = replay(requests, strategies, max_model_len=8, kv_budget_bytes=10_000)
    assert [r.strategy for r in report.rows] == ["slab-8", "slab-16", "slab-8-fp8"]
    assert [r.kv_reserved_bytes for r in report.rows] == [800, 1600, 400]
    assert [r.requests_held for r in report.rows] == [12, 6, 25]
    assert report.rows[1].waste == pytest.approx(1 - 9 / 48)
    assert report.rows[0].waste == report.rows[2].waste  # bytes per token do not change waste


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 50), st.integers(0, 50))
def test_closed_form_held_token_steps(prompt_len, output_len):
    request = Request(prompt_len, output_len)
    steps, held, _ = brute_force([request], max_model_len=10**6)
    assert decode_steps(request) == steps
    assert held_token_steps(request) == held


def test_synthetic_traffic_against_brute_force():
    requests = synthetic_requests(3000, seed=5)
    max_model_len, per_token = 4096, 131_072
    report = replay(requests, [ContiguousStrategy(max_model_len, per_token)], max_model_len,
                    kv_budget_bytes=40 * 2**30)
    steps, held, reserved = brute_force(requests, max_model_len)
    rejected = sum(r.prompt_len + r.output_len > max_model_len for r in requests)
    assert rejected > 0  # the long tail crosses 4,096 tokens
    assert (report.served, report.rejected) == (3000 - rejected, rejected)
    row = report.rows[0]
    assert row.waste == pytest.approx(float(1 - Fraction(held, reserved)), abs=1e-12)
    assert row.kv_reserved_bytes == max_model_len * per_token
    assert row.kv_used_bytes == round(Fraction(held * per_token, steps))
    assert row.requests_held == 40 * 2**30 // (max_model_len * per_token) == 80
    # The naive slab wastes most of its reservation on this traffic (vLLM paper: 60-80 %).
    assert 0.6 < row.waste < 0.8


def test_bad_inputs():
    strategy = [ContiguousStrategy(8, 1)]
    with pytest.raises(ValueError, match="the 1 request is longer than max_model_len=8"):
        replay([Request(6, 5)], strategy, max_model_len=8, kv_budget_bytes=100)
    with pytest.raises(ValueError, match="all 2 requests are longer"):
        replay([Request(6, 5), Request(9, 0)], strategy, max_model_len=8, kv_budget_bytes=100)
    with pytest.raises(ValueError, match="no requests"):
        replay([], strategy, max_model_len=8, kv_budget_bytes=100)
    with pytest.raises(ValueError, match="max_model_len.*0"):
        replay([Request(1, 1)], strategy, max_model_len=0, kv_budget_bytes=100)
    with pytest.raises(ValueError, match="-5"):
        replay([Request(1, 1)], strategy, max_model_len=8, kv_budget_bytes=-5)


def test_format_report_text():
    report = replay([Request(3, 2), Request(2, 0), Request(6, 5)],
                    [ContiguousStrategy(8, 1024)], max_model_len=8, kv_budget_bytes=2**20,
                    workload="hand", model="toy")
    text = format_report(report)
    assert "3 requests, 2 served, 1 rejected" in text
    assert "max_model_len=8" in text
    assert "62.5%" in text  # 1 - 9/24
    assert "(est.)" not in text  # contiguous counts are exact
    assert "8 KiB" in text  # 8 slots x 1 KiB reserved per request
    assert "128" in text    # 1 MiB / 8 KiB requests held
    assert "1,048,576 B" in text


def test_paged_requests_held_is_labelled_an_estimate():
    report = replay([Request(3, 2), Request(1, 0)],
                    [ContiguousStrategy(8, 1), PagedStrategy(4, 1)], max_model_len=8,
                    kv_budget_bytes=100, kv_budget_source="given")
    contiguous, paged = report.rows
    assert contiguous.requests_held_exact and not paged.requests_held_exact
    # Paged: steps hold 3, 4 and 1 tokens in 4, 4 and 4 slots: 12 / 3 = 4 slots per request-step.
    assert paged.kv_reserved_bytes == 4 and paged.requests_held == 25
    text = format_report(report)
    assert "25 (est.)" in text and "steady-state estimate" in text
    assert "= given" in text
    one = format_report(replay([Request(1, 1)], [ContiguousStrategy(8, 1)], 8, 100))
    assert "1 request," in one and "1 requests" not in one
