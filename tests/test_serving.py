"""Stage 7: one scheduler for every strategy. Memory conserved, budgets held, every admissible
request served, model-mode tokens equal to solo no-cache generation (chunked prefill and preemption
included), simulation and model mode deciding alike, traces checked line by line."""

from __future__ import annotations

import hashlib
import json
import math
import random

import pytest
import torch

from kvlab.cli import main
from kvlab.config import LlamaConfig, load_config
from kvlab.errors import KVCacheOutOfMemory
from kvlab.generate import generate
from kvlab.model import LlamaForCausalLM
from kvlab.prefix import PrefixCachingKVCacheManager
from kvlab.serving import (CostModel, Request, RequestState, SamplingParams,
                           Scheduler, SchedulerConfig, SimulatedExecutor, get_card, model_strategy,
                           percentile, plot_memory, poisson_arrivals, serve, simulated_manager,
                           speed_up)
from kvlab.traces import load_trace
from kvlab.traces import TraceFormatError

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=128, name="test-tiny")
BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K and V x layers x KV heads x head_dim x float32
COST = CostModel(CONFIG, get_card("H100-80GB"), dtype="fp32", step_overhead_s=1e-3)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def workload(num=12, seed=3, max_prompt=40, max_output=12, with_ids=True, spread_s=0.02,
             shared_prefix=0):
    """Random requests; the first `shared_prefix` prompt tokens of every other one are common."""
    rng = random.Random(seed)
    common = [rng.randrange(CONFIG.vocab_size) for _ in range(shared_prefix)]
    requests = []
    for i in range(num):
        prompt = rng.randint(1, max_prompt)
        ids = [rng.randrange(CONFIG.vocab_size) for _ in range(prompt)]
        if i % 2 == 0 and shared_prefix:
            ids = common + ids
        requests.append(Request(i, rng.uniform(0, spread_s), len(ids), rng.randint(1, max_output),
                                ids if with_ids else None))
    return requests


def decisions(result_requests):
    return [(r.request_id, r.first_token_s, r.finish_s, r.num_preemptions, r.state)
            for r in sorted(result_requests, key=lambda r: r.request_id)]


# ---- scheduler invariants, driven step by step ----------------------------------------------------

@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix"])
def test_budgets_held_every_step_and_memory_all_free_at_the_end(strategy):
    config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=24)
    kv = simulated_manager(strategy, 6 * 64 * 100, 100, max_model_len=64, block_size=4)
    scheduler = Scheduler(kv, config)
    requests = workload(40, with_ids=False)
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        assert output.num_batched_tokens == sum(n for _, n in output.scheduled)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        assert kv.num_reserved_tokens <= kv.capacity_tokens
        assert all(r.state is RequestState.RUNNING for r in scheduler.running)
        scheduler.update(output, None, float(steps))
        steps += 1
        assert steps < 10_000
    assert kv.num_reserved_tokens == 0
    if strategy != "contiguous":
        assert kv.num_free_blocks == kv.pool.num_blocks
        assert kv.tables == {}
    else:
        assert kv.holders == {} and kv.num_held == 0
    assert all(r.num_output_tokens == r.max_output_tokens for r in requests)


def test_preemption_takes_the_newest_and_admits_nothing_in_that_step():
    kv = simulated_manager("paged", 4 * 4 * 10, 10, max_model_len=16, block_size=4)  # 4 blocks
    scheduler = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    a, b, c, d = (Request(i, 0.0, 4, 8) for i in range(4))
    for request in (a, b, c, d):
        scheduler.add_request(request)
    first = scheduler.schedule()  # each takes one full block (4 prompt tokens): the pool is full
    assert [r.request_id for r in first.admitted] == [0, 1, 2, 3]
    scheduler.update(first, None, 1.0)
    scheduler.add_request(Request(4, 1.0, 1, 1))
    second = scheduler.schedule()  # every one needs a new block, none is free
    assert [r.request_id for r in second.preempted] == [3, 2]  # newest first: d for a, c for b
    assert [r.request_id for r, _ in second.scheduled] == [0, 1]
    assert second.admitted == []  # nothing admitted right after a preemption
    assert [r.request_id for r in scheduler.waiting] == [2, 3, 4]  # preempted first, in order
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.state is RequestState.WAITING and a.state is RequestState.RUNNING


def test_a_request_that_can_never_fit_is_rejected_and_never_stalls_the_others():
    requests = workload(10, with_ids=False)
    requests.insert(3, Request(99, 0.0, 60, 10))  # 70 tokens > max_model_len 64
    for strategy in ("contiguous", "paged", "prefix"):
        kv = simulated_manager(strategy, 2 * 64 * 100, 100, max_model_len=64, block_size=4)
        result = serve(requests, kv, SimulatedExecutor(COST))
        assert (result.finished, result.rejected) == (10, 1)
        assert "70 tokens > max_model_len=64" in result.reject_examples[0]


def test_contiguous_holds_fewer_requests_than_paged_on_the_same_budget():
    requests = workload(60, with_ids=False, spread_s=0.0)
    budget = 4 * 64 * 100  # four max_model_len slabs, or 64 blocks of 4
    results = {s: serve(requests, simulated_manager(s, budget, 100, 64, 4), SimulatedExecutor(COST))
               for s in ("contiguous", "paged")}
    assert results["contiguous"].peak_running == 4
    assert results["paged"].peak_running > 4 * 2
    assert results["paged"].ttft_p99_s < results["contiguous"].ttft_p99_s


def test_plot_memory_keeps_coinciding_strategies_visible_and_says_so():
    import matplotlib

    matplotlib.use("Agg")
    requests = workload(30, with_ids=False, spread_s=0.0)  # no block ids: prefix cache never hits
    budget = 4 * 64 * 100
    results = [serve(requests, simulated_manager(s, budget, 100, 64, 4), SimulatedExecutor(COST))
               for s in ("contiguous", "paged", "prefix")]
    assert results[2].series.running == results[1].series.running  # the two coincide
    axes = plot_memory(results)
    for ax in axes:
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == [
            results[0].strategy, results[1].strategy,
            f"{results[2].strategy} (same as {results[1].strategy})"]
        assert len({line.get_linestyle() for line in lines}) == 3  # each visible through the others
        assert list(lines[2].get_ydata()) == list(lines[1].get_ydata())


# ---- model mode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,budget_tokens",
                         [("contiguous", 3 * 64), ("paged", 30 * 4), ("prefix", 18 * 4)])
def test_model_mode_tokens_equal_solo_generation(model, strategy, budget_tokens):
    requests = workload(12, max_prompt=28, max_output=24, shared_prefix=12)
    kv, executor = model_strategy(strategy, model, budget_tokens * BYTES_PER_TOKEN, 64,
                                  block_size=4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16)  # forces chunked prefill
    result = serve(requests, kv, executor, config)
    assert result.finished == len(requests)
    if strategy != "contiguous":
        assert result.preemptions > 0  # the pool of 30 blocks is too small for the traffic
    if strategy == "prefix":
        assert result.prefix_hit_rate > 0.05
    served = {r.request_id: r for r in result.served_requests}
    for request in requests:
        solo = generate(model, request.prompt_token_ids, request.max_output_tokens,
                        cache="none").token_ids
        assert served[request.request_id].output_token_ids == solo, request.request_id


@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
def test_one_token_prompt_chunks_count_as_prefill_and_sample_nothing(model, strategy):
    # A budget of 2 tokens a step: while A decodes, B's prompt goes in 1-token chunks, decode rows
    # of the same pass. They are prefill tokens, and B samples (from its own random stream) only
    # once its whole prompt is in.
    def pair():
        rng = random.Random(5)
        return [Request(i, 0.0, prompt, output, [rng.randrange(CONFIG.vocab_size)
                                                  for _ in range(prompt)],
                        sampling=SamplingParams(temperature=1.0, stream_seed=100 + i))
                for i, (prompt, output) in enumerate([(3, 12), (9, 4)])]

    def run(config):
        kv, executor = model_strategy(strategy, model, 2 * 64 * BYTES_PER_TOKEN, 64,
                                      block_size=4)
        result = serve(pair(), kv, executor, config)
        return executor, {r.request_id: r.output_token_ids for r in result.served_requests}

    executor, tokens = run(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2))
    assert executor.num_prefill_tokens == 3 + 9
    assert executor.num_decode_tokens == (12 - 1) + (4 - 1)  # every output token but the last
    assert tokens == run(SchedulerConfig())[1]  # the same samples with room for whole prompts


def test_simulation_and_model_mode_make_the_same_decisions(model):
    requests = workload(12)  # no shared prefix: simulation's stand-in ids then hit alike
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=20)
    for strategy, budget_tokens in (("contiguous", 3 * 64), ("paged", 30 * 4),
                                    ("prefix", 30 * 4)):
        budget = budget_tokens * BYTES_PER_TOKEN
        kv, executor = model_strategy(strategy, model, budget, 64, block_size=4, cost_model=COST)
        real = serve(requests, kv, executor, config)
        simulated = serve(requests, simulated_manager(strategy, budget, BYTES_PER_TOKEN, 64, 4),
                          SimulatedExecutor(COST), config)
        assert decisions(real.served_requests) == decisions(simulated.served_requests)
        assert real.series.running == simulated.series.running
        assert real.series.reserved_tokens == simulated.series.reserved_tokens
        assert real.preemptions == simulated.preemptions


def test_simulated_manager_refuses_a_pool_smaller_than_one_request():
    # The same error class as PagedKVCache and ContiguousKVCache raise for the same condition.
    with pytest.raises(KVCacheOutOfMemory, match="max_model_len=64 request needs 16 blocks"):
        simulated_manager("paged", 10 * 4 * 100, 100, max_model_len=64, block_size=4)
    with pytest.raises(KVCacheOutOfMemory, match="no slab"):
        simulated_manager("contiguous", 63 * 100, 100, max_model_len=64)


def test_cli_serve_pool_too_small_is_one_line_and_exit_2(capsys):
    assert main(["serve", "--trace", "azure-conv", "--simulate", "--model", "llama-3.1-8b",
                 "--kv-budget", "0.01", "--max-model-len", "4096", "--num-requests", "5",
                 "--strategy", "paged"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "request needs 256 blocks of 16 tokens" in err


# ---- arrivals, cost model, metrics --------------------------------------------------------------

def test_poisson_arrivals_have_the_asked_rate_and_are_repeatable():
    requests = workload(4000, with_ids=False)
    arrived = poisson_arrivals(requests, rate=50.0, seed=1)
    assert [r.arrival_s for r in arrived] == [r.arrival_s for r in
                                             poisson_arrivals(requests, 50.0, seed=1)]
    mean_gap = arrived[-1].arrival_s / (len(arrived) - 1)
    assert mean_gap == pytest.approx(1 / 50.0, rel=0.05)
    assert [r.arrival_s for r in speed_up(arrived, 2.0)] == [r.arrival_s / 2 for r in arrived]


def test_cost_model_roofline_by_hand():
    config = load_config("llama-3.1-70b")
    cost = CostModel(config, get_card("H100-80GB"), tp=4, dtype="bf16")
    weights = cost.weights_bytes
    # decode: 100 requests holding 1,000 tokens each -> memory-bound
    per_token = 2 * 80 * 2 * 128 * 2  # 2 KV heads per GPU at tp=4, bf16
    assert cost.kv_bytes_per_token == per_token
    seconds = cost.step_time(100, 100 * 1000, 100 * 1001, 100)
    assert seconds == pytest.approx((weights + 100 * 1001 * per_token) / 3.35e12)
    # a 8,192-token prefill -> compute-bound; its last row samples (the LM head once)
    pairs = 8192 * 8193 // 2
    flops = 2 * cost.layer_params * 8192 + 2 * cost.lm_head_params + 4 * 80 * 16 * 128 * pairs
    assert cost.step_time(8192, 0, pairs, 1) == pytest.approx(flops / 989e12)


def test_percentile_matches_numpy():
    numpy = pytest.importorskip("numpy")
    values = [random.Random(i).expovariate(1.0) for i in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def test_prefix_strategy_retries_the_queue_head_without_rehashing():
    calls = []

    def counting_sha256(data: bytes) -> bytes:
        calls.append(data)
        return hashlib.sha256(data).digest()

    kv = PrefixCachingKVCacheManager(7, 16, 112, hash_fn=counting_sha256)

    def admit(request):  # the scheduler's admission; -> tokens found cached, or None
        blocks, cached = kv.get_computed_blocks(request)
        new = kv.allocate_slots(request, request.num_tokens - cached, cached, blocks)
        return None if new is None else cached

    shared = list(range(64))                         # 4 blocks of real ids in common (model mode)
    first = Request(0, 0.0, 80, 4, prompt_token_ids=shared + [100] * 16)
    head = Request(1, 0.0, 100, 4, prompt_token_ids=shared + [200] * 36)
    assert admit(first) == 0                         # 5 blocks, 5 hashed
    hashed_first = len(calls)
    assert admit(head) is None                       # 4 hits + 3 new > 2 free
    hashed_once = len(calls) - hashed_first
    assert hashed_once == 5                          # blocks 0-3 hit, block 4 missed
    for _ in range(5):
        assert admit(head) is None                   # every step's retry: no hashing
    assert len(calls) - hashed_first == hashed_once
    kv.free(first)
    assert admit(head) == 64                         # the shared 64 tokens hit; 96 // 16 = 6 full
    assert len(calls) - hashed_first == 6            # blocks, block 5 the only new hash


# ---- traces and the command ----------------------------------------------------------------------

def test_simulation_stand_in_ids_share_exactly_the_blocks_the_trace_shares():
    from kvlab.prefix.trace_blocks import token_ids

    a = Request(0, 0.0, 1100, 5, trace_block_ids=(7, 8, 9), trace_block_size=512)
    b = Request(1, 0.0, 1030, 5, trace_block_ids=(7, 8, 4), trace_block_size=512)
    ids_a, ids_b = token_ids(a, 0, 1100), token_ids(b, 0, 1030)
    assert len(ids_a) == 1100 and len(ids_b) == 1030
    assert ids_a[:1024] == ids_b[:1024] and ids_a[1024:1030] != ids_b[1024:1030]
    assert token_ids(a, 1000, 1105) == ids_a[1000:] + [-1] * 5  # outputs: the request's own id
    plain = Request(2, 0.0, 40, 3)
    assert token_ids(plain, 0, 43) == [-3] * 43


def test_malformed_traces_are_rejected_with_file_and_line(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\n"
                   "2023-11-16 18:15:47.00,ten,5\n")
    with pytest.raises(TraceFormatError, match=r"t\.csv:3: ContextTokens='ten'"):
        load_trace(csv)
    jsonl = tmp_path / "m.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
    for bad, message in [("{not json\n", "not a JSON object"),
                         ('{"timestamp": 5, "input_length": 0, "output_length": 1}\n',
                          "input_length=0 must be >= 1"),
                         ('{"timestamp": 1, "input_length": 3, "output_length": 1, '
                          '"hash_ids": ["a"]}\n', "hash_ids")]:
        jsonl.write_text(good + bad)
        with pytest.raises(TraceFormatError, match=rf"m\.jsonl:2: .*{message}"):
            load_trace(jsonl)
    jsonl.write_text(good)
    [row] = load_trace(jsonl)
    assert (row.prompt_len, row.output_len, row.trace_block_ids, row.trace_block_size) == \
        (600, 3, (1, 2), 512)


def test_cli_serve_simulate_json(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rows = [f"2023-11-16 18:15:{10 + i // 10:02d}.{i % 10}000000,{100 + 37 * i % 900},{5 + i % 50}"
            for i in range(200)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    assert main(["serve", "--trace", str(trace), "--simulate", "--model", "llama-3.1-8b",
                 "--gpu", "L4", "--kv-budget", "1", "--max-model-len", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["strategy"] for row in out["rows"]] == ["contiguous", "paged", "paged+prefix"]
    for row in out["rows"]:
        assert row["finished"] == 200 and row["rejected"] == 0
        for key in ("peak_running", "mean_running", "preemptions", "kv_usage_mean",
                    "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                    "tpot_p99_s", "prefix_hit_rate", "readmitted_hit_rate",
                    "readmitted_hit_tokens"):
            assert key in row
    contiguous, paged, prefix = out["rows"]
    # The Azure format carries no prefix information: no hit at a first admission (vLLM's hit
    # rate); a request back after a preemption may re-find its own blocks, counted apart.
    assert prefix["prefix_hit_rate"] == 0.0 and prefix["prefix_hit_tokens"] == 0
    assert prefix["readmitted_hit_tokens"] == 0 or prefix["preemptions"] > 0
    assert paged["readmitted_hit_rate"] is paged["readmitted_hit_tokens"] is None
    assert contiguous["peak_running"] == (2**30 // (2048 * 131072))  # 4 slabs of 2,048 tokens
    assert paged["peak_running"] > contiguous["peak_running"]


def _serve_json(tmp_path, capsys, *flags):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:15:10.{i}000000,{100 + i},5\n" for i in range(10)))
    assert main(["serve", "--trace", str(trace), "--simulate", "--model", "llama-3.1-8b",
                 "--kv-budget", "1", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpu, expected", [
    ("H100-80GB", (1024, 8192)), ("H200", (1024, 8192)), ("MI300X", (1024, 8192)),
    ("A100-80GB", (256, 2048)),   # >= 70 GiB, but vLLM keeps the A100 on the small defaults
    ("A100-40GB", (256, 2048)), ("L4", (256, 2048))])
def test_cli_serve_step_budgets_follow_vllms_rule_for_the_card(tmp_path, capsys, gpu, expected):
    out = _serve_json(tmp_path, capsys, "--gpu", gpu, "--strategy", "paged")
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == expected


def test_cli_serve_explicit_step_budgets_win(tmp_path, capsys):
    out = _serve_json(tmp_path, capsys, "--gpu", "H100-80GB", "--strategy", "paged",
                      "--max-num-seqs", "3", "--max-num-batched-tokens", "512")
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (3, 512)
    assert out["rows"][0]["peak_running"] <= 3


def test_step_budget_defaults_without_a_gpu_are_the_small_ones():
    from kvlab.cli.serve import scheduler_defaults

    assert scheduler_defaults(None, None) == (256, 2048)   # model mode on the CPU


def test_cli_serve_strategy_accepts_the_table_name(tmp_path, capsys):
    for name in ("prefix", "paged+prefix"):
        out = _serve_json(tmp_path, capsys, "--strategy", name)
        assert [row["strategy"] for row in out["rows"]] == ["paged+prefix"]


def test_cli_serve_says_under_the_table_what_the_hit_columns_count(tmp_path, capsys):
    from kvlab.serving.metrics import HIT_NOTE

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:15:10.{i}000000,{100 + i},5\n" for i in range(10)))
    for strategy, noted in (("paged+prefix", True), ("paged", False)):
        assert main(["serve", "--trace", str(trace), "--simulate", "--model", "llama-3.1-8b",
                     "--kv-budget", "1", "--strategy", strategy]) == 0
        lines = capsys.readouterr().out.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
        assert lines[header].endswith("prefix hit  re-admit hit")
        assert (lines[header + 3] == HIT_NOTE) is noted  # header, rule, the row, then the note
        assert lines[header + 3 + noted].startswith("clock: calibrated")


def test_cli_serve_bad_trace_is_one_line_and_exit_2(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5}\n')
    assert main(["serve", "--trace", str(trace), "--simulate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:1: missing field 'output_length'" in err


def test_progress_bar_stays_off_when_stderr_is_not_a_terminal(capsys):
    # Even when asked for, a bar written to a log or a pipe would be thousands of lines.
    kv = simulated_manager("paged", 2 * 64 * 100, 100, max_model_len=64, block_size=4)
    serve(workload(10, with_ids=False), kv, SimulatedExecutor(COST), progress=True)
    assert capsys.readouterr().err == ""
