"""`kvlab report` gains a paged+prefix row when the workload carries prefix hashes (Mooncake)."""

from __future__ import annotations

import json

from cli_run import run
from kvlab.lifetime import held_token_steps
from kvlab.prefix.report_row import PrefixPagedStrategy, mooncake_report_workload
from kvlab.prefix.trace_hit_rate import lru_hit_rate
from kvlab.report import PagedStrategy, replay
from kvlab.traces.mooncake import load_mooncake_trace
from kvlab.workload import Request


def test_a_cached_prefix_is_paid_for_once_by_hand():
    # 40 prompt tokens, 3 generated: the steps hold 40, 41, 42 tokens = 3 blocks of 16 each.
    plain, cached = Request(40, 3), Request(40, 3, num_cached_tokens=32)
    paged, prefix = PagedStrategy(16, 2), PrefixPagedStrategy(16, 2)
    assert paged.reserved_token_steps(plain) == prefix.reserved_token_steps(plain) == 3 * 48
    assert prefix.reserved_token_steps(cached) == 3 * 48 - 3 * 32  # 2 shared blocks per step
    assert prefix.held_token_steps(cached) == held_token_steps(cached) - 3 * 32 == 27
    # A hit that is not a whole number of this block size shares only its whole blocks.
    assert PrefixPagedStrategy(24, 2).reserved_token_steps(cached) == 3 * 48 - 3 * 24


def test_mooncake_workload_carries_each_requests_hit():
    requests, label, hits = mooncake_report_workload("mooncake-synthetic", 512 * 100 * 1000,
                                                     1000, max_model_len=32768, limit=300)
    served = [r for r in load_mooncake_trace("synthetic", limit=300).requests
              if r.total_len <= 32768]
    assert hits.num_hit_tokens == lru_hit_rate(served, 100).num_hit_tokens > 0
    assert sum(r.num_cached_tokens for r in requests) == hits.num_hit_tokens
    assert len(requests) == 300 and "prefix cache hit rate" in label
    report = replay(requests, [PagedStrategy(16, 1000), PrefixPagedStrategy(16, 1000)], 32768,
                    10**9)
    paged, prefix = report.rows
    assert prefix.kv_reserved_bytes < paged.kv_reserved_bytes
    assert 0 <= prefix.waste < 1 and prefix.requests_held >= paged.requests_held


def test_report_adds_the_row_only_for_prefix_traces(capsys):
    code, out, err = run(capsys, "report", "--trace", "mooncake-synthetic", "--max-model-len",
                         "32768", "--num-requests", "300", "--json")
    assert code == 0, err
    rows = [row["strategy"] for row in json.loads(out)["rows"]]
    assert rows[-2:] == ["paged", "paged+prefix"]
    code, out, err = run(capsys, "report", "--trace", "mooncake-conversation", "--max-model-len",
                         "131072", "--num-requests", "200")
    assert code == 0, err
    assert "paged+prefix" in out and "an LRU prefix cache on the KV budget (912 blocks" in out
    code, out, err = run(capsys, "report", "--num-requests", "200", "--json")
    assert "paged+prefix" not in out
    code, out, err = run(capsys, "report", "--trace", "mooncake-chat")
    # Not a shipped name: the one message every command gives for a --trace that is no trace.
    assert code == 2 and "mooncake-chat: no such file, and not a shipped trace; expected a " \
        "shipped trace (azure-conv, azure-code, mooncake-conversation, mooncake-synthetic)" in err
