"""The CPU clock's machinery (never its timings): the fit recovers a clock from step times it
made (every step's, or only the intervals between sampled tokens), the batch loop records what
`serve` measures, the stored comparisons replay with vLLM's decisions at every step, and the
prediction scales with the clock."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvlab.tools.calibration import against_vllm as av
from kvlab.tools.calibration import cpu_clock as cc
from kvlab.calibration.clock import describe_clock
from kvlab.config import load_config
from kvlab.serving import SchedulerConfig, SimulatedExecutor, serve
from kvlab.serving.strategies import paged_manager
from kvlab.tools.vllm_compare.settings import EngineSettings
from kvlab.tools.vllm_compare.table import timing
from kvlab.tools.vllm_compare.workloads import Workload

ROOT = Path(__file__).resolve().parents[1]
SMOLLM = load_config("smollm2-135m")
CLOCK = cc.CpuClock(flops_per_s=30e9, bandwidth_bytes_per_s=12e9, step_overhead_s=4e-3)
MOONCAKE_RUNS = sorted((ROOT / "results" / "cpu-vllm").glob("parity_mooncake_*.json"))


def test_fit_recovers_the_clock_that_made_the_step_times():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 2048, 60)
    cached = rng.integers(0, 1024, 60)
    sizes = np.stack([tokens, cached, tokens * cached + tokens * (tokens + 1) // 2,
                      rng.integers(0, 8, 60)], axis=1)
    sizes[:20, 0] = rng.integers(1, 4, 20)  # some decode steps: bandwidth-bound
    cost = CLOCK.cost_model(SMOLLM)
    seconds = np.array([cost.step_time(*map(int, row)) for row in sizes])
    fitted = cc.fit_cpu_clock(SMOLLM, [cc.StepTimes.from_seconds(sizes, seconds)])
    assert fitted.flops_per_s == pytest.approx(30e9, rel=1e-3)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(12e9, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(4e-3, rel=1e-3)
    assert max(map(abs, fitted.measured["errors"])) < 1e-3
    seen = cc.StepTimes.from_seconds(sizes, seconds)
    given = cc.fit_cpu_clock(SMOLLM, [seen], bandwidth_bytes_per_s=12e9)  # the other two fitted
    assert (given.flops_per_s, given.step_overhead_s) == (pytest.approx(30e9, rel=1e-3),
                                                          pytest.approx(4e-3, rel=1e-3))
    assert given.bandwidth_bytes_per_s == 12e9
    with pytest.raises(ValueError, match="need >= 3 intervals"):
        cc.fit_cpu_clock(SMOLLM, [cc.StepTimes.from_seconds(sizes[:2], seconds[:2])])
    # Only some step ends seen (as in an engine's token times): fitted on the intervals.
    hidden = cc.StepTimes(seen.sizes, np.where(np.arange(60) % 3 == 1, np.nan, seen.ends))
    group, durations = hidden.intervals()
    assert len(durations) == 40 and durations.sum() == pytest.approx(seen.ends[-1])
    assert cc.fit_cpu_clock(SMOLLM, [hidden]).flops_per_s == pytest.approx(30e9, rel=1e-3)


def test_the_batch_loop_measures_what_serve_measures():
    rng = np.random.default_rng(1)
    workload = Workload("w", [rng.integers(0, 1000, n).tolist() for n in (40, 300, 90, 700)],
                        [12, 5, 30, 8], {})
    cost, config = CLOCK.cost_model(SMOLLM), SchedulerConfig(256, 256)
    recorded = cc.run_batch(cc.batch_requests(workload), paged_manager(40, 32, 1024),
                            SimulatedExecutor(cost), config)
    served = serve(cc.batch_requests(workload), paged_manager(40, 32, 1024),
                   SimulatedExecutor(cost), config)
    ours = timing(recorded)
    assert ours.output_tokens == served.output_tokens == sum(workload.max_tokens)
    assert ours.tokens_per_s == pytest.approx(served.output_tokens_per_s, rel=1e-12)
    assert ours.ttft_p50_s == pytest.approx(served.ttft_p50_s, rel=1e-12)
    assert ours.tpot_p50_s == pytest.approx(served.tpot_p50_s, rel=1e-12)
    steps = recorded["step_times"]
    assert steps.ends[-1] == pytest.approx(served.duration_s, rel=1e-12)
    assert steps.sizes[:, 0].sum() == sum(len(p) for p in workload.prompts) + sum(
        n - 1 for n in workload.max_tokens) + served.recomputed_tokens


@pytest.mark.parametrize("path", MOONCAKE_RUNS, ids=lambda p: p.stem)
def test_a_stored_comparison_replays_with_vllms_decisions_and_scales_with_the_clock(path):
    stored = json.loads(path.read_text())
    workload = av.stored_workload(stored, SMOLLM.vocab_size)
    figures = av.predict_comparison(stored, workload, CLOCK.cost_model(SMOLLM))
    assert figures["steps_equal"] and figures["steps"][0] == len(stored["vllm"]["steps"]["running"])
    assert figures["vllm"] == timing(stored["vllm"])
    slower = dataclasses.replace(CLOCK, flops_per_s=15e9, bandwidth_bytes_per_s=6e9,
                                 step_overhead_s=8e-3)
    twice = av.predict_comparison(stored, workload, slower.cost_model(SMOLLM))["predicted"]
    once = figures["predicted"]
    # A batch given up front: the clock changes no decision, so every time doubles.
    assert twice.ttft_p50_s == pytest.approx(2 * once.ttft_p50_s, rel=1e-9)
    assert twice.tpot_p50_s == pytest.approx(2 * once.tpot_p50_s, rel=1e-9)
    assert twice.tokens_per_s == pytest.approx(once.tokens_per_s / 2, rel=1e-9)
    # vLLM's step ends, read off its token times, line up with the simulated steps.
    steps = av.engine_steps(stored, workload, CLOCK.cost_model(SMOLLM), "vllm")
    seen = steps.ends[~np.isnan(steps.ends)]
    assert np.all(np.diff(seen) > 0) and seen[-1] == figures["vllm"].duration_s
    first, *rest = stored["workload"]["prompt_lengths"]
    changed = {**stored, "workload": {**stored["workload"], "prompt_lengths": [first + 1, *rest]}}
    with pytest.raises(ValueError, match="is not the stored one"):
        av.stored_workload(changed, SMOLLM.vocab_size)


def test_time_steps_gives_one_median_per_step_of_kvlabs_model_mode():
    from kvlab.checkpoint import load_model

    model = load_model("tiny")
    workload = Workload("w", [[5, 6, 7, 8] * 10, [9, 10] * 30, [11] * 50], [4, 3, 6], {})
    settings = EngineSettings(num_blocks=12, max_num_batched_tokens=64, max_model_len=256)
    (steps,) = cc.time_steps(model, [(workload, settings)], repeats=2)
    assert steps.sizes.shape == (len(steps.ends), 4) and np.all(np.diff(steps.ends) > 0)
    assert steps.sizes[:, 0].sum() == 40 + 60 + 50 + (3 + 2 + 5)  # prompts, then the decodes
    assert steps.sizes[:, 3].sum() == 4 + 3 + 6  # one row sampled per output token


@pytest.mark.parametrize("name", ["cpu_clock_avx2.json", "cpu_clock_epyc512.json"])
def test_a_stored_clock_is_the_fit_of_its_stored_steps_by_todays_cost_model(name):
    # cpu_clock_avx2.json was refitted when the LM head moved to sampled rows only, and
    # cpu_clock_epyc512.json timed after: the probes replay to the stored steps, and fitting them
    # again gives the stored numbers.
    stored = cc.CpuClock.load(ROOT / "results" / "cpu-vllm" / name)
    again = cc.refit(stored, SMOLLM)
    assert [p["sizes"] for p in again.measured["probes"]] == \
        [p["sizes"] for p in stored.measured["probes"]]
    assert again.flops_per_s == pytest.approx(stored.flops_per_s, rel=1e-6)
    assert again.step_overhead_s == pytest.approx(stored.step_overhead_s, rel=1e-6)
    assert again.bandwidth_bytes_per_s == stored.bandwidth_bytes_per_s  # measured, kept
    older = dataclasses.replace(stored, measured={**stored.measured, "probes": [
        {**p, "sizes": p["sizes"][1:]} for p in stored.measured["probes"]]})
    with pytest.raises(ValueError, match="other steps"):
        cc.refit(older, SMOLLM)


def test_the_read_bandwidth_is_the_weights_bytes_over_the_median_pass(monkeypatch):
    from kvlab.checkpoint import load_model

    model = load_model("tiny")
    clock = iter([0.0, 2.0, 10.0, 11.0, 20.0, 24.0])  # passes of 2, 1 and 4 s: the median is 2
    monkeypatch.setattr(cc.time, "perf_counter", lambda: next(clock))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert cc.measure_read_bandwidth(model, repeats=3) == weights / 2


def test_a_clock_round_trips_through_its_file(tmp_path):
    path = tmp_path / "cpu_clock.json"
    path.write_text(json.dumps(CLOCK.to_json()))
    assert cc.CpuClock.load(path) == CLOCK
    with pytest.raises(FileNotFoundError, match="python -m kvlab.tools.calibration.cpu_clock"):
        cc.CpuClock.load(tmp_path / "none.json")
    assert "+4.00 ms a step" in describe_clock(CLOCK.cost_model(SMOLLM))


@pytest.mark.parametrize("path", sorted((ROOT / "results/cpu-vllm").glob("cpu_clock*.json")),
                         ids=lambda p: p.stem)
def test_a_stored_cpu_clock_is_the_fit_of_its_stored_steps(path):
    stored = cc.CpuClock.load(path)
    measured = stored.measured["bandwidth"].startswith("measured")
    refitted = cc.fit_cpu_clock(SMOLLM, stored.timed_steps(), bandwidth_bytes_per_s=(
        stored.bandwidth_bytes_per_s if measured else None))
    for name in ("flops_per_s", "bandwidth_bytes_per_s", "step_overhead_s"):
        assert getattr(refitted, name) == pytest.approx(getattr(stored, name), rel=1e-6)
    assert refitted.measured["errors"] == stored.measured["errors"]
