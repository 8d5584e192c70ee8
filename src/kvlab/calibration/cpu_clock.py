"""A clock for this machine's CPU, fitted by timing kvlab's own engine, and what the simulator
predicts of vLLM's CPU build with it.

The calibrated clock (`clock`) is fitted to published GPU figures that cannot be re-measured here.
On this machine one real engine can be measured against the simulator end to end: vLLM's CPU build,
run by `kvlab compare-vllm` on the same workloads with the same settings (results/cpu-vllm/). So:

1. `time_steps` runs probe workloads through kvlab's model mode (SmolLM2-135M, fp32, 1 thread) and
   keeps every engine step's sizes (tokens computed, cached tokens read, attention pairs:
   `CostModel.step_sizes`) and its wall seconds (the whole step: schedule, forward pass, sampling,
   update), the median of a few repeats. Every request arrives at once, so no decision depends on
   the clock and the repeats' steps line up.
2. `fit_cpu_clock` chooses the cost model's numbers for this CPU: its memory bandwidth is measured
   (`measure_read_bandwidth`: one pass over the weights, the read a decode step makes), its
   effective FLOP rate and a per-step overhead are fitted by least squares on log step time
   (`clock.levenberg_marquardt`). Left free, the bandwidth is not pinned by these steps (every
   decode step reads about the same bytes, so the fit trades the weights' read against the
   overhead). There is no datasheet peak to derate: the rates are the card's (`Card`), at 100 %.
3. `predict_comparison` replays a stored comparison's workload in simulation mode at that clock
   (kvlab's scheduler, which made vLLM's decisions at every step of those runs) and computes
   tokens/s, TTFT and TPOT from the simulated token times with the comparison's own arithmetic
   (`kvlab.vllm_compare.table.timing`), to set beside vLLM's measured figures.

The probes (`probes`) are not the compared workloads (a Mooncake slice from further down the
trace, and short prompts of synthetic ids), so the prediction is out of sample twice: other
requests, another engine. `python -m kvlab.calibration.cpu_clock --time` times, fits and stores the clock
(results/cpu-vllm/cpu_clock.json); without `--time` it prints the prediction table.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import LlamaConfig
from ..serving.cost_model import Card, CostModel
from ..serving.engine_core import Executor, SimulatedExecutor, engine_step, paged_manager
from ..serving.request import Request
from ..serving.scheduler import Scheduler, SchedulerConfig
from ..vllm_compare.settings import EngineSettings
from ..vllm_compare.table import first_difference, timing
from ..vllm_compare.workloads import Workload
from .clock import levenberg_marquardt

__all__ = ["StepTimes", "CpuClock", "run_batch", "time_steps", "fit_cpu_clock",
           "measure_read_bandwidth", "predict_comparison", "stored_workload", "probes"]

CARD_NAME = "this CPU, 1 thread (fitted)"


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Engine steps: `sizes` (steps, 3): tokens computed, cached tokens read, attention pairs;
    `seconds` (steps,): wall time of each."""

    sizes: np.ndarray
    seconds: np.ndarray


@dataclasses.dataclass(frozen=True)
class CpuClock:
    """A fitted CPU clock and how it was measured (see the module docstring)."""

    flops_per_s: float
    bandwidth_bytes_per_s: float
    step_overhead_s: float
    model: str = "smollm2-135m"
    dtype: str = "fp32"
    threads: int = 1
    # date, machine, load, the timed steps (step_sizes, step_seconds) and the fit's errors
    measured: dict = dataclasses.field(default_factory=dict)

    def timed_steps(self) -> StepTimes:
        """The steps the clock was fitted to (stored with it)."""
        return StepTimes(np.array(self.measured["step_sizes"], dtype=np.float64),
                         np.array(self.measured["step_seconds"]))

    def cost_model(self, config: LlamaConfig) -> CostModel:
        """The simulator's clock for `config` on this CPU (one 'GPU', tp 1)."""
        card = Card(CARD_NAME, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    self.bandwidth_bytes_per_s, self.flops_per_s)
        return CostModel(config, card, 1, self.dtype, step_overhead_s=self.step_overhead_s,
                         clock="cpu")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "CpuClock":
        """Raises FileNotFoundError (with how to make one) when `path` does not exist."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no CPU clock; time one with python -m "
                                    f"kvlab.calibration.cpu_clock --time")
        return cls(**json.loads(path.read_text()))


def run_batch(requests: Sequence[Request], kv, executor: Executor, config: SchedulerConfig,
              wall_clock: bool = False) -> dict:
    """Serve a batch that arrives at t = 0, step by step, recorded as `kvlab compare-vllm` records
    an engine. A step's seconds are the executor's, or with `wall_clock` the wall time of the whole
    engine step (schedule, execute, update).

    Returns:
        a result with 'steps' (running and waiting after each decision), 'token_times_s' (per
        request, each output token's step end), 'num_preemptions', and 'step_times' (`StepTimes`
        of the steps that ran).
    """
    scheduler = Scheduler(kv, config)
    for request in requests:
        if not scheduler.add_request(request):
            raise ValueError(f"request {request.request_id} ({request.num_tokens} tokens) was "
                             f"rejected: {request.reject_reason}")
    running, waiting, sizes, seconds = [], [], [], []
    times: dict[int, list[float]] = {r.request_id: [] for r in requests}
    before: dict[int, int] = {}

    def on_scheduled(output) -> None:
        running.append(len(scheduler.running))
        waiting.append(len(scheduler.waiting))
        if output.scheduled:
            sizes.append(CostModel.step_sizes(output.scheduled))
        before.clear()
        before.update((r.request_id, r.num_output_tokens) for r, _ in output.scheduled)

    now = 0.0
    while scheduler.has_unfinished():
        started = time.perf_counter()
        step = engine_step(scheduler, executor, now, on_scheduled)
        if not step.output.scheduled:
            continue  # the only running request preempted itself: nothing ran
        seconds.append(time.perf_counter() - started if wall_clock else step.seconds)
        now += seconds[-1]
        for request, _ in step.output.scheduled:
            times[request.request_id] += [now] * (request.num_output_tokens
                                                   - before[request.request_id])
    return {"steps": {"running": running, "waiting": waiting},
            "token_times_s": [times[r.request_id] for r in requests],
            "num_preemptions": scheduler.num_preemptions,
            "step_times": StepTimes(np.array(sizes, dtype=np.float64), np.array(seconds))}


def _requests(workload: Workload) -> list[Request]:
    return [Request(i, 0.0, len(prompt), n, prompt_token_ids=list(prompt))
            for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens))]


def _scheduler_config(settings: EngineSettings) -> SchedulerConfig:
    return SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens)


def _blocks(settings: EngineSettings, config: LlamaConfig) -> int:
    from ..paged.budget import kv_block_bytes

    return settings.kvlab_blocks(kv_block_bytes(config, settings.block_size, "fp32"))


def probes(vocab_size: int) -> list[tuple[Workload, EngineSettings]]:
    """The workloads timed for the fit, with the compared runs' settings but a pool of 96 blocks:
    12 Mooncake requests from line 400 of the trace (long prompts), prefilled whole (2,048 tokens
    a step) and in chunks of 256; and 16 prompts of 48 synthetic ids generating 9, 11 .. 39 tokens,
    so that decode batches shrink from 16 requests to 1."""
    from ..vllm_compare.workloads import mooncake_workload

    rng = np.random.default_rng(0)
    short = Workload("short", [rng.integers(0, vocab_size, 48).tolist() for _ in range(16)],
                     [9 + 2 * i for i in range(16)], {"prompt_tokens": 48, "seed": 0})
    mooncake = mooncake_workload(vocab_size, 12, start=400, max_tokens=16)
    return [(mooncake, EngineSettings(num_blocks=96)),
            (mooncake, EngineSettings(num_blocks=96, max_num_batched_tokens=256)),
            (short, EngineSettings(num_blocks=96))]


def time_steps(model, timed: Sequence[tuple[Workload, EngineSettings]],
               repeats: int = 3) -> StepTimes:
    """Every step of each (workload, settings) through kvlab's model mode, each step's seconds
    the median of `repeats` runs (`settings.threads` torch threads).

    Raises:
        RuntimeError: two repeats made different steps (they cannot: the batch arrives at once).
    """
    import torch

    from ..serving.engine_core import model_strategy
    from ..sizing import kv_bytes_per_token

    per_token = kv_bytes_per_token(model.config, model.dtype)
    sizes, seconds = [], []
    for workload, settings in timed:
        torch.set_num_threads(settings.threads)
        runs = []
        for _ in range(repeats):
            budget = _blocks(settings, model.config) * settings.block_size * per_token
            kv, runner = model_strategy("paged", model, budget, settings.max_model_len,
                                        settings.block_size)
            runs.append(run_batch(_requests(workload), kv, runner, _scheduler_config(settings),
                                  wall_clock=True)["step_times"])
        if any(not np.array_equal(run.sizes, runs[0].sizes) for run in runs):
            raise RuntimeError(f"{workload.name}: the repeats made different steps")
        sizes.append(runs[0].sizes)
        seconds.append(np.median([run.seconds for run in runs], axis=0))
    return StepTimes(np.concatenate(sizes), np.concatenate(seconds))


def _work(config: LlamaConfig, steps: StepTimes, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes moved, FLOPs) of each step: the cost model's, which no card changes."""
    unit = CostModel(config, Card("unit", 0, 1.0, 1.0), 1, dtype)
    return unit.step_work(*steps.sizes.T)


def measure_read_bandwidth(model, repeats: int = 5) -> float:
    """Bytes/s of reading every weight of `model` once (a sum over each parameter), the median of
    `repeats` passes, on torch's current threads: what a decode step pays to stream the weights."""
    import torch

    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    passes = []
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            for p in params:
                p.sum()
            passes.append(time.perf_counter() - started)
    return total / statistics.median(passes)


def fit_cpu_clock(config: LlamaConfig, steps: StepTimes, dtype: str = "fp32",
                  bandwidth_bytes_per_s: float | None = None) -> CpuClock:
    """The FLOP rate, bandwidth and per-step overhead that best explain `steps` (least squares on
    log(predicted / measured)); with `bandwidth_bytes_per_s` (measured) only the other two are
    fitted. `measured['errors']` holds each step's error (predicted / measured - 1).

    Raises:
        ValueError: fewer than 3 steps, or a step of no time.
    """
    if len(steps.seconds) < 3 or np.any(steps.seconds <= 0):
        raise ValueError(f"need >= 3 steps of positive time to fit 3 numbers, got "
                         f"{len(steps.seconds)} (shortest {steps.seconds.min(initial=0):g} s)")
    moved, flops = _work(config, steps, dtype)

    def unpack(theta):
        if bandwidth_bytes_per_s is None:
            return np.exp(theta)
        flop_rate, overhead = np.exp(theta)
        return flop_rate, bandwidth_bytes_per_s, overhead

    def errors(theta):
        flop_rate, bandwidth, overhead = unpack(theta)
        return np.log((np.maximum(moved / bandwidth, flops / flop_rate) + overhead)
                      / steps.seconds)

    start = [1e10, 1e-3] if bandwidth_bytes_per_s is not None else [1e10, 1e10, 1e-3]
    theta = levenberg_marquardt(errors, np.log(start), iterations=100)
    flop_rate, bandwidth, overhead = (float(v) for v in unpack(theta))
    return CpuClock(flop_rate, bandwidth, overhead, dtype=dtype,
                    measured={"steps": len(steps.seconds),
                              "bandwidth": "fitted" if bandwidth_bytes_per_s is None else
                              "measured (measure_read_bandwidth)",
                              "errors": np.round(np.expm1(errors(theta)), 4).tolist()})


def predict_comparison(stored: dict, workload: Workload, cost: CostModel) -> dict:
    """A stored `kvlab compare-vllm --json` run replayed in simulation mode at `cost`'s clock.

    Returns:
        {'predicted': `timing` of the simulated run, 'vllm' and 'kvlab': `timing` of each engine's
        measured one, 'steps_equal': the running count after every decision equals vLLM's (bool),
        'steps': (simulated, vLLM's) step counts}.

    Raises:
        ValueError: `workload` is not the stored one (prompt lengths or output tokens differ).
    """
    lengths = [len(p) for p in workload.prompts]
    if (lengths != stored["workload"]["prompt_lengths"]
            or workload.max_tokens != stored["workload"]["max_tokens"]):
        raise ValueError(f"the {workload.name} workload built here ({sum(lengths):,} prompt "
                         f"tokens, {sum(workload.max_tokens):,} output) is not the stored one "
                         f"({sum(stored['workload']['prompt_lengths']):,}, "
                         f"{sum(stored['workload']['max_tokens']):,})")
    settings = EngineSettings(**stored["settings"])
    kv = paged_manager(_blocks(settings, cost.config), settings.block_size, settings.max_model_len,
                       settings.enable_prefix_caching)
    simulated = run_batch(_requests(workload), kv, SimulatedExecutor(cost),
                          _scheduler_config(settings))
    ours, theirs = simulated["steps"]["running"], stored["vllm"]["steps"]["running"]
    return {"predicted": timing(simulated), "vllm": timing(stored["vllm"]),
            "kvlab": timing(stored["kvlab"]),
            "steps_equal": first_difference(ours, theirs) is None,
            "steps": (len(ours), len(theirs))}


def stored_workload(stored: dict, vocab_size: int) -> Workload:
    """The workload of a stored comparison, built again (chats need SmolLM2's tokenizer)."""
    from ..vllm_compare.workloads import chat_workload, mooncake_workload

    w = stored["workload"]
    if w["name"] == "chats":
        from ..checkpoint import load_chat_template, load_tokenizer

        return chat_workload(load_tokenizer("smollm2-135m"), load_chat_template("smollm2-135m"),
                             w["num_chats"], max(w["max_tokens"]))
    return mooncake_workload(vocab_size, w["num_requests"], w["shrink"], w["max_prompt_tokens"],
                             max(w["max_tokens"]), w["start"], w["seed"])


def _load_average() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvlab.calibration.cpu_clock [--time]`: time and fit the CPU clock (--time), then
    print the prediction of every stored comparison beside vLLM's and kvlab's measured figures."""
    import argparse

    import torch

    from ..checkpoint import load_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--time", action="store_true", help="time kvlab's model mode, fit, store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock-file", default="results/cpu-vllm/cpu_clock.json")
    parser.add_argument("--results", default="results/cpu-vllm")
    args = parser.parse_args(argv)
    model = load_model("smollm2-135m", dtype=torch.float32)
    if args.time:
        load = _load_average()
        started = time.perf_counter()
        torch.set_num_threads(1)
        bandwidth = measure_read_bandwidth(model)
        timed = time_steps(model, probes(model.config.vocab_size), repeats=args.repeats)
        steps = StepTimes(timed.sizes, np.round(timed.seconds, 6))  # as stored
        fitted = fit_cpu_clock(model.config, steps, bandwidth_bytes_per_s=bandwidth)
        errors = fitted.measured["errors"]
        fitted = dataclasses.replace(fitted, measured={
            **fitted.measured, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average_before": load, "load_average_after": _load_average(),
            "wall_s": round(time.perf_counter() - started, 1), "repeats": args.repeats,
            "median_abs_error": round(statistics.median(abs(e) for e in errors), 4),
            "step_sizes": steps.sizes.astype(int).tolist(), "step_seconds": steps.seconds.tolist()})
        Path(args.clock_file).write_text(json.dumps(fitted.to_json(), indent=1) + "\n")
    clock = CpuClock.load(args.clock_file)
    cost = clock.cost_model(model.config)
    print(f"CPU clock ({args.clock_file}): {clock.flops_per_s / 1e9:.1f} GFLOP/s, "
          f"{clock.bandwidth_bytes_per_s / 1e9:.1f} GB/s, {clock.step_overhead_s * 1e3:.1f} ms a "
          f"step; fit over {clock.measured['steps']} steps, median |error| "
          f"{clock.measured['median_abs_error']:.0%}")
    rows = []
    for path in sorted(Path(args.results).glob("parity_*.json")):
        stored = json.loads(path.read_text())
        rows.append((path.stem, predict_comparison(
            stored, stored_workload(stored, model.config.vocab_size), cost)))
    for engine in ("vllm", "kvlab"):
        print(f"\n| run | steps equal | tokens/s: {engine} / simulated (error) | TTFT p50 ms | "
              f"TPOT p50 ms |\n|---|---|---|---|---|")
        for name, figures in rows:
            p, m = figures["predicted"], figures[engine]
            cells = [f"{a:,.{d}f} / {b:,.{d}f} ({b / a - 1:+.0%})" for a, b, d in (
                (m.tokens_per_s, p.tokens_per_s, 1), (1e3 * m.ttft_p50_s, 1e3 * p.ttft_p50_s, 0),
                (1e3 * m.tpot_p50_s, 1e3 * p.tpot_p50_s, 0))]
            print(f"| {name} | {figures['steps_equal']} ({figures['steps'][0]}) | "
                  + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
