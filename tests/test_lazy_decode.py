"""`kvlab.lazy_decode.serve` (decoding requests advanced lazily) gives exactly the result of
`engine_core.serve` (every request touched every step): the same step series, every request's
first-token and finish times, outputs, preemptions and prefix hits, and the same figures, for every
strategy, on slices of both traces, with memory short enough to preempt, a token budget that runs
out before the last prompt (chunked prefill) and idle gaps between arrivals."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvlab import lazy_decode
from kvlab.config import load_config
from kvlab.serving import (Request, SchedulerConfig, SimulatedExecutor, from_sizes, serve,
                           shrink, simulated_manager, speed_up)
from kvlab.gpus import get_card
from kvlab.serving.cost_model import CostModel
from kvlab.serving.engine_core import engine_step
from kvlab.traces import load_trace

COST = CostModel(load_config("llama-3.1-8b"), get_card("L4"))


def azure(count: int, speed: float):
    return speed_up(from_sizes(load_trace("azure-conv", limit=count)), speed)


def mooncake(count: int, speed: float):
    return speed_up(shrink(from_sizes(load_trace("mooncake-conversation", limit=count)), 8), speed)


def chats(count: int):
    """Short prompts, long answers, arriving fast: many more decoding than prefilling."""
    rng = random.Random(0)
    return [Request(i, i * 0.01, rng.randrange(4, 40), rng.randrange(100, 300))
            for i in range(count)]


def record(request):
    return (request.request_id, request.first_token_s, request.finish_s, request.num_output_tokens,
            request.num_preemptions, request.num_cached_tokens, request.state,
            request.finish_reason, request.reject_reason)


def both_ways(requests, strategy, budget_tokens, max_model_len, config, monkeypatch):
    """(step by step, lazy) results of one replay, with how many steps the lazy loop left to
    engine_step and how many it ran where the token budget ran out."""
    def replay(serve_fn):
        kv = simulated_manager(strategy, budget_tokens * 100, 100, max_model_len, 16)
        return serve_fn(requests, kv, SimulatedExecutor(COST), config, 100, progress=False)

    counts = {"full steps": 0, "budget ran out": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return counted

    plain = replay(serve)
    monkeypatch.setattr(lazy_decode.engine_core, "engine_step",
                        counting("full steps", engine_step))
    monkeypatch.setattr(lazy_decode._LazyReplay, "_budget",
                        counting("budget ran out", lazy_decode._LazyReplay._budget))
    lazy = replay(lazy_decode.serve)
    return plain, lazy, counts


def figures(result) -> dict:
    """Every field of a ServeResult but the replay's own speed."""
    return {key: value for key, value in dataclasses.asdict(result).items()
            if key not in ("wall_s", "events_per_s")}


def assert_same(plain, lazy):
    assert lazy.series == plain.series
    assert [record(r) for r in lazy.served_requests] == [record(r) for r in plain.served_requests]
    assert figures(lazy) == figures(plain)


CASES = {  # name: (requests, KV budget in tokens, max_model_len, scheduler config)
    "azure, memory short": (lambda: azure(300, 8), 9000, 4096, SchedulerConfig(64, 2048)),
    # the decoding requests leave too little of the token budget for the prompts: chunks
    "chats, budget short": (lambda: chats(400), 80000, 512, SchedulerConfig(256, 96)),
    "azure, idle gaps": (lambda: azure(150, 0.5), 20000, 4096, SchedulerConfig(32, 1024)),
    "mooncake, memory short": (lambda: mooncake(200, 20), 4000, 2048, SchedulerConfig(32, 512)),
}


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix"])
@pytest.mark.parametrize("case", list(CASES))
def test_lazy_replay_decides_as_the_step_by_step_replay(case, strategy, monkeypatch):
    make, budget_tokens, max_model_len, config = CASES[case]
    plain, lazy, counts = both_ways(make(), strategy, budget_tokens, max_model_len, config,
                                    monkeypatch)
    assert_same(plain, lazy)
    assert plain.finished > 100
    # The lazy loop did the work: engine_step only ran the steps that started with nobody running.
    assert counts["full steps"] < plain.num_steps / 10, (counts, plain.num_steps)
    if case.endswith("memory short") and strategy != "contiguous":
        assert plain.preemptions > 0
    if case.endswith("budget short"):
        assert counts["budget ran out"] > plain.num_steps / 10


def test_what_it_cannot_make_lazy_goes_to_the_step_by_step_serve(monkeypatch):
    class TokenIds(SimulatedExecutor):  # not the plain SimulatedExecutor: its ids are read
        def execute(self, output):
            _, seconds = super().execute(output)
            return {r.request_id: 0 for r, _ in output.scheduled}, seconds

    called = []
    monkeypatch.setattr(lazy_decode.engine_core, "serve",
                        lambda *args, **kwargs: called.append(args) or "step by step")
    requests = azure(20, 8)
    kv = simulated_manager("paged", 9000 * 100, 100, 4096, 16)
    assert lazy_decode.serve(requests, kv, TokenIds(COST)) == "step by step"
    forked = requests[:3]
    forked[0].forks = [dataclasses.replace(forked[1], request_id=99)]
    assert lazy_decode.serve(forked, kv, SimulatedExecutor(COST)) == "step by step"
    assert len(called) == 2
