"""The Mooncake trace reader (format checks with file:line, max_model_len, block-size expansion)
and the prefix cache replayed on the real traces' block hashes."""

from __future__ import annotations

import json

import pytest

from kvlab.errors import SizingError
from kvlab.prefix.trace_hit_rate import (hit_rate_curve, lru_hit_rate, pool_blocks_for,
                                         unbounded_hit_rate)
from kvlab.traces.mooncake import (DATA_DIR, TraceFormatError, block_keys, expand_hash_ids,
                                   load_mooncake_trace)
from kvlab.workload import Request


def write_trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows)
                    + "\n")
    return path


GOOD = {"timestamp": 7, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}


def test_shipped_traces_load_with_their_notice():
    conversation = load_mooncake_trace("conversation")
    synthetic = load_mooncake_trace("synthetic")
    assert (len(conversation), len(synthetic)) == (12031, 3993)
    assert conversation.num_rejected == 0 and conversation.max_model_len is None
    # The published mean prompt lengths (README: 12,035 and 15,325 tokens).
    assert round(conversation.num_prompt_tokens / len(conversation)) == 12035
    assert round(synthetic.num_prompt_tokens / len(synthetic)) == 15325
    assert "Apache License" in (DATA_DIR / "LICENSE-APACHE").read_text()
    assert "Qin et al." in (DATA_DIR / "NOTICE.md").read_text()


def test_max_model_len_rejects_and_counts():
    trace = load_mooncake_trace("synthetic", max_model_len=131072)
    assert (len(trace), trace.num_rejected, trace.num_lines) == (3983, 10, 3993)
    assert all(request.total_len <= 131072 for request in trace.requests)
    small = load_mooncake_trace("conversation", max_model_len=8192, limit=100)
    assert small.num_lines == 100 and len(small) + small.num_rejected == 100
    assert small.num_rejected == sum(1 for r in load_mooncake_trace("conversation", limit=100)
                                     .requests if r.total_len > 8192)


@pytest.mark.parametrize("row, message", [
    ("{not json", r"trace.jsonl:2: not a JSON object"),
    ("[1, 2]", r"trace.jsonl:2: expected a JSON object, got list"),
    ({**GOOD, "input_length": "600"}, r"trace.jsonl:2: input_length='600' is not an integer"),
    ({**GOOD, "input_length": 0, "hash_ids": []}, r":2: input_length=0 must be >= 1"),
    ({k: v for k, v in GOOD.items() if k != "output_length"}, r":2: missing field 'output_length'"),
    ({**GOOD, "output_length": -1}, r":2: output_length=-1 must be >= 0"),
    ({**GOOD, "hash_ids": [0]}, r":2: input_length=600 needs 2 hash_ids .* got 1"),
    ({**GOOD, "hash_ids": [0, "x"]}, r":2: hash_ids must be a list of integers"),
    ({**GOOD, "timestamp": 3}, r":2: timestamp 3 ms is before the previous line's 7 ms"),
])
def test_malformed_lines_are_named_by_file_and_line(tmp_path, row, message):
    path = write_trace(tmp_path, [GOOD, row])
    with pytest.raises(TraceFormatError, match=message):
        load_mooncake_trace(path)


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_mooncake_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        load_mooncake_trace("conversation", max_model_len=0)


def test_block_size_expansion_inherits_the_512_token_identity():
    assert expand_hash_ids([7, 9], 600, 512) == [7, 9]
    # 600 tokens at block size 128 = 5 blocks: 4 from id 7, then the first of id 9.
    assert expand_hash_ids([7, 9], 600, 128) == [28, 29, 30, 31, 36]
    request = Request(600, 1, trace_block_ids=(7, 9), trace_block_size=512)
    assert block_keys(request, 256) == [14, 15, 18]
    with pytest.raises(ValueError, match="block_size must divide 512"):
        expand_hash_ids([7], 10, 48)


# ---- hit rate on the real traces ---------------------------------------------------------------

def test_unbounded_is_the_ceiling_and_lru_reaches_it_when_nothing_is_evicted():
    requests = load_mooncake_trace("synthetic", limit=600).requests
    ceiling = unbounded_hit_rate(requests)
    big = lru_hit_rate(requests, capacity_blocks=10**6)
    assert big.num_evictions == 0
    assert big.num_hit_tokens == ceiling.num_hit_tokens > 0
    curve = hit_rate_curve(requests, [200, 800, 3200, 12800])
    rates = [point.hit_rate for point in curve]
    assert rates == sorted(rates) and rates[-1] <= ceiling.hit_rate  # more cache never hurts here
    assert curve[0].num_evictions > curve[-1].num_evictions


def test_hit_rate_by_hand_on_a_small_trace(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},
            {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
            {"timestamp": 2, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 3]},
            {"timestamp": 3, "input_length": 600, "output_length": 1, "hash_ids": [5, 6]}]
    requests = load_mooncake_trace(write_trace(tmp_path, rows)).requests
    ceiling = unbounded_hit_rate(requests)
    # Request 2 hits block 0 only (1024 tokens: the n - 1 cap), request 3 hits 0 and 1.
    assert ceiling.num_hit_tokens == 512 + 1024 and ceiling.num_query_tokens == 3824
    tiny = lru_hit_rate(requests, capacity_blocks=3)
    # Request 1's partial block 2 is never cached, so request 2 recomputes its block 1 (the cap)
    # into it: a duplicate. Request 3 hits 0 and 1 and evicts the duplicate for its own block 2;
    # request 4 evicts block 1. The ceiling is reached with 3 blocks.
    assert tiny.num_hit_tokens == 512 + 1024 and tiny.num_evictions == 2
    assert lru_hit_rate(requests, capacity_blocks=2).num_too_big == 2
    # At block size 256 the same prefixes are hit in 256-token pieces.
    assert unbounded_hit_rate(requests, 256).num_hit_tokens == 3 * 256 + 4 * 256


def test_pool_capacity_of_a_named_card():
    # 0.9 x 80 GiB = 77,309,411,328 B; 8.03 billion bf16 weights = 16,060,522,496 B; the rest
    # over 128 KiB per token: 467,292 tokens.
    left = 77_309_411_328 - 16_060_522_496
    assert pool_blocks_for("llama-3.1-8b", "H100-80GB") == left // (512 * 131072) == 912
    assert pool_blocks_for("llama-3.1-8b", "H100-80GB", block_size=16) == left // (16 * 131072)
    # 70B on 8 cards: each holds 1/8 of the weights and 40 KiB of every token's K/V.
    assert pool_blocks_for("llama-3.1-70b", "H100-80GB", num_gpus=8) == 2845
    # A card by name only: "local" (this machine's GPU, which `kvlab size` accepts) is refused.
    with pytest.raises(SizingError, match="unknown GPU 'local'; known: T4, L4"):
        pool_blocks_for("llama-3.1-8b", "local")
