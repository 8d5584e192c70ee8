"""Issue 10: one scheduler for every strategy, offline and online. The batch engine of stages 4-6
(`LLMEngine`) and stage 7's `serve` run the same `Scheduler`, KV managers and `ModelRunner`, so
what the engine does (n > 1 forks with copy-on-write, sampling from per-request streams, forced
first tokens, end-of-sequence) must come out the same through `serve` for every strategy,
contiguous included, with or without preemption."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.generate import generate
from kvlab.model import LlamaForCausalLM
from kvlab.sampling import stream_seed
from kvlab.serving import (STRATEGIES, LLMEngine, ModelRunner, Request, RequestState,
                           SamplingParams, SchedulerConfig, generate_batch, model_strategy,
                           serve)

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=128, name="test-tiny")
BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K and V x layers x KV heads x head_dim x float32
N = 3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def prompts(num=5, seed=4):
    rng = random.Random(seed)
    return [[rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(3, 14))]
            for _ in range(num)]


def families(prompt_list, new, temperature, eos=None, first_tokens=None):
    """`serve`'s requests for n = N completions of each prompt, seeded as `LLMEngine` seeds a
    request with its own seed (here: the prompt's index)."""
    requests, next_id = [], 0
    for index, prompt in enumerate(prompt_list):
        members = []
        for sibling in range(N):
            first = None if first_tokens is None else first_tokens[sibling]
            params = SamplingParams(temperature, stream_seed("request", index, sibling)
                                    if temperature else None, {eos} - {None}, first)
            members.append(Request(next_id, 0.001 * index, len(prompt), new, prompt,
                                   sampling=params))
            next_id += 1
        members[0].forks = members[1:]
        requests.append(members[0])
    return requests


def outputs_by_prompt(result):
    ordered = sorted(result.served_requests, key=lambda r: r.request_id)
    return [[r.output_token_ids for r in ordered[i:i + N]] for i in range(0, len(ordered), N)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("budget_tokens", [2000, 100], ids=["roomy", "tight"])
def test_serve_samples_forks_exactly_as_the_batch_engine(model, strategy, budget_tokens):
    prompt_list = prompts()
    expected = generate_batch(model, prompt_list, 9, block_size=4, n=N, temperature=0.9,
                              seeds=list(range(len(prompt_list)))).completions
    if strategy == "contiguous":
        budget_tokens = {2000: 2000, 100: 4 * 32}[budget_tokens]  # 4 slabs: room for one family
    kv, executor = model_strategy(strategy, model, budget_tokens * BYTES_PER_TOKEN, 32,
                                  block_size=4)
    result = serve(families(prompt_list, 9, 0.9), kv, executor,
                   SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=24))
    assert outputs_by_prompt(result) == expected
    assert result.finished == N * len(prompt_list)
    if budget_tokens < 200 and strategy != "contiguous":
        assert result.preemptions > 0  # siblings preempted and recomputed, samples unchanged
    assert kv.num_reserved_tokens == 0 and not executor.generators


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forced_first_tokens_and_eos_through_every_strategy(model, strategy):
    prompt_list = prompts(3, seed=9)
    greedy = [[generate(model, p + [t], 6, cache="none").token_ids for t in (5, 6, 7)]
              for p in prompt_list]
    eos = greedy[0][1][2]  # a token the second sibling of prompt 0 produces: it stops there
    kv, executor = model_strategy(strategy, model, 1000 * BYTES_PER_TOKEN, 32, block_size=4)
    result = serve(families(prompt_list, 7, 0.0, eos=eos, first_tokens=(5, 6, 7)), kv, executor)
    for got, want in zip(outputs_by_prompt(result), greedy):
        for sibling_got, (first, rest) in zip(got, zip((5, 6, 7), want)):
            full = [first] + rest
            stop = full.index(eos) + 1 if eos in full[1:] else len(full)
            assert sibling_got == full[:stop]
    reasons = {r.finish_reason for r in result.served_requests}
    assert reasons == {"stop", "length"}
    if strategy != "contiguous":
        assert kv.num_cow_copies > 0  # siblings diverged inside a shared block


def test_contiguous_fork_takes_a_slab_of_its_own_and_copies_the_prompt(model):
    kv, executor = model_strategy("contiguous", model, 3 * 32 * BYTES_PER_TOKEN, 32)
    [parent] = families(prompts(1), 4, 0.0)
    result = serve([parent], kv, executor)
    assert result.peak_running == N and result.finished == N
    # one owner of the slabs: the manager claimed, forked and freed them through the cache
    assert kv.num_held == 0 and kv.slab_of == {} and not any(executor.cache.in_use)
    assert executor.slabs is kv and kv.cache is executor.cache
    # A family needs n slabs at once: with 2 slabs it waits forever, so it is refused up front.
    kv, executor = model_strategy("contiguous", model, 2 * 32 * BYTES_PER_TOKEN, 32)
    assert kv.allocate_slots(families(prompts(1), 4, 0.0)[0], 100) is None


def test_a_contiguous_cache_without_its_manager_is_refused(model):
    _, executor = model_strategy("contiguous", model, 3 * 32 * BYTES_PER_TOKEN, 32)
    with pytest.raises(ValueError, match="ContiguousManager that hands out its slabs"):
        ModelRunner(model, executor.cache)  # slabs= missing: nobody says whose slab is whose
    other, _ = model_strategy("contiguous", model, 3 * 32 * BYTES_PER_TOKEN, 32)
    with pytest.raises(ValueError, match="ContiguousManager that hands out its slabs"):
        ModelRunner(model, executor.cache, slabs=other)  # a manager over another cache


def test_a_rejected_request_takes_its_forks_with_it_and_the_others_run(model):
    kv, executor = model_strategy("paged", model, 200 * BYTES_PER_TOKEN, 32, block_size=4)
    too_long, fine = families([[1] * 30, [2, 3, 4]], 8, 0.0)
    result = serve([too_long, fine], kv, executor)
    states = sorted((r.request_id, r.state) for r in result.served_requests)
    assert states == [(0, RequestState.REJECTED), (1, RequestState.REJECTED),
                      (2, RequestState.REJECTED), (3, RequestState.FINISHED),
                      (4, RequestState.FINISHED), (5, RequestState.FINISHED)]
    assert result.rejected == N and "max_model_len=32" in result.reject_examples[0]


def test_the_batch_engine_is_the_serving_scheduler(model):
    engine = LLMEngine(model, num_blocks=8, block_size=4, max_model_len=24, max_num_seqs=4)
    ids = [engine.add_request(p, 8, n=2, first_tokens=[1, 2]) for p in prompts(3)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert len(engine.running) <= 4  # max_num_seqs counts every completion of a request
        assert engine.cache.manager.num_used_blocks <= 8
    assert engine.stats.num_steps == steps and engine.stats.num_preemptions > 0
    assert all(len(c) == 8 for rid in ids for c in engine.outputs(rid))
    assert engine.cache.manager.num_free_blocks == 8


def test_sampling_params_refuse_what_would_be_silently_wrong():
    with pytest.raises(ValueError, match="needs a stream_seed"):
        SamplingParams(0.7)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(float("nan"), 1)
    with pytest.raises(ValueError, match="stop_token_ids entry must be a token id >= 0, got -1"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="stop_token_ids must be a collection of token ids, got 2"):
        SamplingParams(stop_token_ids=2)  # one id where a set belongs would be read as no id
    assert SamplingParams(stop_token_ids=[2, 0, 2]).stop_token_ids == frozenset({0, 2})


def test_prefix_manager_reserves_step_by_step_like_the_paged_one():
    # Issue 10's fair comparison: with nothing to share, paged + prefix must take the same blocks
    # at the same steps as paging (vLLM v1 allocates what each step computes), chunked prefill
    # included. It used to reserve whole prompts at admission, which alone spared it preemptions.
    from kvlab.serving import SimulatedExecutor, simulated_manager
    from kvlab.gpus import get_card
    from kvlab.serving.cost_model import CostModel

    rng = random.Random(2)
    requests = [Request(i, 0.0, rng.randint(20, 90), rng.randint(1, 30)) for i in range(40)]
    cost = CostModel(CONFIG, get_card("H100-80GB"), dtype="fp32")
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32)  # prompts in chunks
    runs = {name: serve(requests, simulated_manager(name, 2000 * BYTES_PER_TOKEN, BYTES_PER_TOKEN,
                                                    128, block_size=4),
                        SimulatedExecutor(cost), config)
            for name in ("paged", "prefix")}
    paged, prefix = runs["paged"], runs["prefix"]
    assert paged.preemptions == prefix.preemptions == 0 and prefix.prefix_hit_rate == 0
    assert prefix.series.reserved_tokens == paged.series.reserved_tokens
    assert prefix.series.running == paged.series.running


def test_designs_with_one_sequence_per_request_refuse_forks_on_arrival():
    from kvlab.tools.oom_story.naive import NaiveManager

    kv = NaiveManager(CONFIG, torch.float32, "cpu", 32, capacity_bytes=10**6)
    [parent] = families(prompts(1), 4, 0.0)
    assert "n = 3 completions: the naive strategy holds one sequence" in kv.reject_reason(parent)
    with pytest.raises(RuntimeError, match="never forks"):
        kv.fork(parent, parent.forks[0])
    assert kv.reject_reason(families(prompts(1), 4, 0.0)[0].forks[0]) is None  # n = 1 is fine


@pytest.mark.parametrize("strategy", ["paged", "prefix"])
def test_admission_needs_room_for_the_whole_prompt_as_in_vllm(strategy):
    # vLLM 0.32's `scheduler_reserve_full_isl` (on by default): a waiting request is admitted only
    # if the free blocks could hold its whole prompt, although only the first chunk gets slots.
    # Pool: 5 blocks of 4. A runs (8 prompt tokens; its first decode token opens a third block, 2
    # free); B's 16-token prompt needs 4 blocks, its first chunk (4 tokens: a budget of 5 less A's
    # decode token) only 1.
    from kvlab.serving import Scheduler, simulated_manager

    def first_steps(reserve_full_isl):
        kv = simulated_manager(strategy, 5 * 4 * BYTES_PER_TOKEN, BYTES_PER_TOKEN, 20,
                               block_size=4)
        scheduler = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                                  scheduler_reserve_full_isl=reserve_full_isl))
        a, b = Request(0, 0.0, 8, 4), Request(1, 0.0, 16, 2)
        scheduler.add_request(a)
        scheduler.update(scheduler.schedule(), None, 1.0)   # A's prompt: 2 blocks
        scheduler.config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5,
                                           scheduler_reserve_full_isl=reserve_full_isl)
        scheduler.add_request(b)
        output = scheduler.schedule()
        return [(r.request_id, n) for r, n in output.scheduled], kv.num_free_blocks

    assert first_steps(True) == ([(0, 1)], 2)            # B waits: 4 blocks > 2 free
    assert first_steps(False) == ([(0, 1), (1, 4)], 1)   # B's first chunk let in on 1 block
