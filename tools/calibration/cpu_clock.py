"""A clock for this machine's CPU, fitted by timing kvlab's own engine.

The calibrated clock (`kvlab.calibration.clock`) is fitted to published GPU figures that cannot be
re-measured here. On this machine one real engine can be measured against the simulator end to
end: vLLM's CPU build, run by `kvlab compare-vllm` on the same workloads with the same settings
(`against_vllm`). The simulator needs a clock for this CPU first:

1. `time_steps` runs probe workloads (`probes`) through kvlab's model mode (SmolLM2-135M, fp32,
   1 thread) and keeps every engine step's sizes (tokens computed, cached tokens read, attention
   pairs, rows sampled: `CostModel.step_sizes`) and wall seconds (the whole step: schedule,
   forward pass, sampling, update), the median of a few repeats. Every request arrives at once,
   so no decision depends on the clock and the repeats' steps line up.
2. `fit_cpu_clock` chooses the cost model's numbers for this CPU: its memory bandwidth is measured
   (`measure_read_bandwidth`: one pass over the weights, the read a decode step makes); its
   effective FLOP rate and a per-step overhead are fitted by least squares on log step time
   (`fit_clock.levenberg_marquardt`). Left free, the bandwidth is not pinned by these steps (every
   decode step reads about the same bytes, so the fit trades the weights' read against the
   overhead). There is no datasheet peak to derate: the rates are the card's (`Card`), at 100 %.
   The fit also takes runs whose step ends are seen only where a token was sampled (an engine's
   token times): it then matches the time between two seen ends (`StepTimes.intervals`).

The probes are not the compared workloads (a Mooncake slice from further down the trace, and short
prompts of synthetic ids). `python -m kvlab.tools.calibration.cpu_clock` times, fits and stores
the clock in results/cpu-vllm/cpu_clock.json, with the steps it was fitted to.
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

from kvlab.config import LlamaConfig
from kvlab.gpus import Card
from kvlab.serving.cost_model import CostModel
from kvlab.serving.engine_core import Executor, engine_step
from kvlab.serving.request import Request
from kvlab.serving.scheduler import Scheduler, SchedulerConfig
from ..vllm_compare.settings import EngineSettings
from ..vllm_compare.workloads import Workload
from .fit_clock import levenberg_marquardt

__all__ = ["StepTimes", "CpuClock", "run_batch", "batch_requests", "scheduler_config",
           "pool_blocks", "time_steps", "fit_cpu_clock", "measure_read_bandwidth", "probes",
           "probe_sizes", "refit", "DEFAULT_FILE"]

CARD_NAME = "this CPU, 1 thread (fitted)"
DEFAULT_FILE = "results/cpu-vllm/cpu_clock.json"


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One run's engine steps: `sizes` (steps, 4): tokens computed, cached tokens read, attention
    pairs, rows sampled; `ends` (steps,): seconds from the run's start at which each step ended,
    nan where no token was sampled (an engine's token times show only the ends of steps that
    sample)."""

    sizes: np.ndarray
    ends: np.ndarray

    @classmethod
    def from_seconds(cls, sizes, seconds) -> "StepTimes":
        return cls(np.asarray(sizes, dtype=np.float64), np.cumsum(seconds))

    def intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """(the interval of each step, or -1 after the last observed end; each interval's
        seconds): an interval is the steps up to and including an observed end."""
        observed = ~np.isnan(self.ends)
        group = np.concatenate(([0], np.cumsum(observed)[:-1]))
        durations = np.diff(np.concatenate(([0.0], self.ends[observed])))
        return np.where(group < len(durations), group, -1), durations


@dataclasses.dataclass(frozen=True)
class CpuClock:
    """A fitted CPU clock and how it was measured (see the module docstring)."""

    flops_per_s: float
    bandwidth_bytes_per_s: float
    step_overhead_s: float
    model: str = "smollm2-135m"
    dtype: str = "fp32"
    threads: int = 1
    # date, machine, load, the timed steps ('probes': sizes and seconds) and the fit's errors
    measured: dict = dataclasses.field(default_factory=dict)

    def timed_steps(self) -> list[StepTimes]:
        """The steps the clock was fitted to (stored with it), one `StepTimes` per probe."""
        return [StepTimes.from_seconds(probe["sizes"], probe["seconds"])
                for probe in self.measured["probes"]]

    def cost_model(self, config: LlamaConfig) -> CostModel:
        """The simulator's clock for `config` on this CPU (one 'GPU', tp 1)."""
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
        card = Card(CARD_NAME, memory_gib, self.bandwidth_bytes_per_s, self.flops_per_s)
        return CostModel(config, card, 1, self.dtype, step_overhead_s=self.step_overhead_s,
                         clock="cpu")

    def describe(self) -> str:
        """One line: the three numbers and the fit's typical error."""
        errors = self.measured.get("errors", [])
        typical = (f"; fit over {len(errors)} intervals, median |error| "
                   f"{statistics.median(abs(e) for e in errors):.0%}" if errors else "")
        return (f"CPU clock: {self.flops_per_s / 1e9:.1f} GFLOP/s, "
                f"{self.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
                f"({self.measured.get('bandwidth', 'given')}), "
                f"{self.step_overhead_s * 1e3:.1f} ms a step{typical}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "CpuClock":
        """Raises FileNotFoundError (with how to make one) when `path` does not exist."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no CPU clock; time one with python -m "
                                    f"kvlab.tools.calibration.cpu_clock")
        return cls(**json.loads(path.read_text()))


def run_batch(requests: Sequence[Request], kv, executor: Executor, config: SchedulerConfig,
              wall_clock: bool = False) -> dict:
    """Serve a batch that arrives at t = 0, step by step, recorded as `kvlab compare-vllm` records
    an engine. A step's seconds are the executor's, or with `wall_clock` the wall time of the whole
    engine step (schedule, execute, update).

    Returns:
        a result with 'steps' (running and waiting after each decision), 'token_times_s' (per
        request, each output token's step end), 'token_steps' (per request, the index of the step
        that sampled each token), 'num_preemptions', and 'step_times' (`StepTimes` of the steps
        that ran).
    """
    scheduler = Scheduler(kv, config)
    for request in requests:
        if not scheduler.add_request(request):
            raise ValueError(f"request {request.request_id} ({request.num_tokens} tokens) was "
                             f"rejected: {request.reject_reason}")
    running, waiting, sizes, seconds = [], [], [], []
    times: dict[int, list[float]] = {r.request_id: [] for r in requests}
    token_steps: dict[int, list[int]] = {r.request_id: [] for r in requests}
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
            new = request.num_output_tokens - before[request.request_id]
            times[request.request_id] += [now] * new
            token_steps[request.request_id] += [len(seconds) - 1] * new
    return {"steps": {"running": running, "waiting": waiting},
            "token_times_s": [times[r.request_id] for r in requests],
            "token_steps": [token_steps[r.request_id] for r in requests],
            "num_preemptions": scheduler.num_preemptions,
            "step_times": StepTimes.from_seconds(np.array(sizes).reshape(-1, 4), seconds)}


def batch_requests(workload: Workload) -> list[Request]:
    """The workload as requests arriving at t = 0, prompts as token ids."""
    return [Request(i, 0.0, len(prompt), n, prompt_token_ids=list(prompt))
            for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens))]


def scheduler_config(settings: EngineSettings) -> SchedulerConfig:
    """kvlab's step budgets under vLLM's settings of the same names."""
    return SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens)


def pool_blocks(settings: EngineSettings, config: LlamaConfig) -> int:
    """kvlab's pool in blocks for these settings (vLLM's usable pool: `kvlab_blocks`)."""
    from kvlab.paged.budget import kv_block_bytes

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
               repeats: int = 3) -> list[StepTimes]:
    """Every step of each (workload, settings) through kvlab's model mode, each step's seconds
    the median of `repeats` runs (`settings.threads` torch threads); one `StepTimes` each.

    Raises:
        RuntimeError: two repeats made different steps (they cannot: the batch arrives at once).
    """
    import torch

    from kvlab.serving.strategies import model_strategy
    from kvlab.sizing import kv_bytes_per_token

    per_token = kv_bytes_per_token(model.config, model.dtype)
    probes_timed = []
    for workload, settings in timed:
        torch.set_num_threads(settings.threads)
        runs = []
        for _ in range(repeats):
            budget = pool_blocks(settings, model.config) * settings.block_size * per_token
            kv, runner = model_strategy("paged", model, budget, settings.max_model_len,
                                        settings.block_size)
            runs.append(run_batch(batch_requests(workload), kv, runner, scheduler_config(settings),
                                  wall_clock=True)["step_times"])
        if any(not np.array_equal(run.sizes, runs[0].sizes) for run in runs):
            raise RuntimeError(f"{workload.name}: the repeats made different steps")
        seconds = np.median([np.diff(run.ends, prepend=0.0) for run in runs], axis=0)
        probes_timed.append(StepTimes.from_seconds(runs[0].sizes, seconds))
    return probes_timed


def probe_sizes(config: LlamaConfig) -> list[np.ndarray]:
    """Each probe's step sizes (steps, 4), from a simulated replay: the batch arrives at once, so
    no decision depends on the clock, and the steps are the ones `time_steps` times."""
    from kvlab.serving.engine_core import SimulatedExecutor
    from kvlab.serving.strategies import paged_manager

    any_clock = CpuClock(1e10, 1e10, 0.0).cost_model(config)
    return [run_batch(batch_requests(workload),
                      paged_manager(pool_blocks(settings, config), settings.block_size,
                                    settings.max_model_len),
                      SimulatedExecutor(any_clock), scheduler_config(settings))["step_times"].sizes
            for workload, settings in probes(config.vocab_size)]


def refit(clock: CpuClock, config: LlamaConfig) -> CpuClock:
    """`clock` fitted again to its stored step times, with today's cost model: each stored probe's
    steps get the sizes a replay gives now (the stored columns must agree), its bandwidth stays
    the measured one. How a change to the cost model is carried to clocks already measured.

    Raises:
        ValueError: the stored probes are not today's (other steps).
    """
    stored = clock.measured["probes"]
    sizes = probe_sizes(config)
    if len(stored) != len(sizes):
        raise ValueError(f"{len(stored)} stored probes, today's are {len(sizes)}: other steps")
    for number, (probe, now) in enumerate(zip(stored, sizes)):
        old = np.asarray(probe["sizes"])
        if not np.array_equal(old, now[:, :old.shape[1]]):
            raise ValueError(f"stored probe {number} made other steps than today's probes")
    fitted = fit_cpu_clock(config, [StepTimes.from_seconds(now, probe["seconds"])
                                    for probe, now in zip(stored, sizes)], clock.dtype,
                           clock.bandwidth_bytes_per_s)
    probes_now = [{**probe, "sizes": now.astype(int).tolist()} for probe, now in zip(stored, sizes)]
    return dataclasses.replace(fitted, measured={
        **clock.measured, **fitted.measured, "probes": probes_now,
        "refitted": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})


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


def fit_cpu_clock(config: LlamaConfig, runs: Sequence[StepTimes], dtype: str = "fp32",
                  bandwidth_bytes_per_s: float | None = None) -> CpuClock:
    """The FLOP rate, bandwidth and per-step overhead that best explain the runs' observed
    intervals (least squares on log(predicted / measured)); with `bandwidth_bytes_per_s`
    (measured) only the other two are fitted. `measured['errors']` holds each interval's error
    (predicted / measured - 1): each step's, where every step end is observed.

    Raises:
        ValueError: fewer than 3 intervals, or one of no time.
    """
    parts = []  # (bytes, FLOPs, interval of each step, interval seconds) per run
    for run in runs:
        group, durations = run.intervals()
        parts.append((*_work(config, run, dtype), group, durations))
    durations = np.concatenate([part[3] for part in parts])
    if len(durations) < 3 or np.any(durations <= 0):
        raise ValueError(f"need >= 3 intervals of positive time to fit 3 numbers, got "
                         f"{len(durations)} (shortest {durations.min(initial=0):g} s)")

    def unpack(theta):
        if bandwidth_bytes_per_s is None:
            return np.exp(theta)
        flop_rate, overhead = np.exp(theta)
        return flop_rate, bandwidth_bytes_per_s, overhead

    @np.errstate(over="ignore", divide="ignore")  # a rate the steps do not pin may run off
    def errors(theta):
        flop_rate, bandwidth, overhead = unpack(theta)
        predicted = []
        for moved, flops, group, seconds in parts:
            steps = np.maximum(moved / bandwidth, flops / flop_rate) + overhead
            kept = group >= 0
            predicted.append(np.bincount(group[kept], steps[kept], minlength=len(seconds)))
        return np.log(np.concatenate(predicted) / durations)

    # The surface has poor local minima (an overhead driven to 0 with too slow a FLOP rate):
    # start from a few overheads, 1 ms to 100 ms, and keep the best fit.
    starts = [[1e10, overhead] if bandwidth_bytes_per_s is not None else [1e10, 1e10, overhead]
              for overhead in (1e-3, 1e-2, 1e-1)]
    fits = [levenberg_marquardt(errors, np.log(start), iterations=100) for start in starts]
    theta = min(fits, key=lambda fit: float(np.sum(errors(fit) ** 2)))
    with np.errstate(over="ignore"):
        flop_rate, bandwidth, overhead = (float(v) for v in unpack(theta))
    fit_errors = np.round(np.expm1(errors(theta)), 4).tolist()
    return CpuClock(flop_rate, bandwidth, overhead, dtype=dtype,
                    measured={"intervals": len(durations),
                              "bandwidth": "fitted" if bandwidth_bytes_per_s is None else
                              "measured (measure_read_bandwidth)",
                              "errors": fit_errors,
                              "median_abs_error": round(statistics.median(map(abs, fit_errors)),
                                                        4)})


def _load_average() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvlab.tools.calibration.cpu_clock`: time kvlab's model mode on the probes, fit
    the CPU clock and store it (with the steps it was fitted to); `against_vllm` then uses it."""
    import argparse

    import torch

    from kvlab.checkpoint import load_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_FILE)
    parser.add_argument("--refit", metavar="FILE", help="fit a stored clock again to its stored "
                        "step times with today's cost model (no timing), written back to FILE")
    args = parser.parse_args(argv)
    if args.refit:
        from kvlab.config import load_config

        fitted = refit(CpuClock.load(args.refit), load_config("smollm2-135m"))
        Path(args.refit).write_text(json.dumps(fitted.to_json(), indent=1) + "\n")
        print(f"{fitted.describe()}\nstored in {args.refit}")
        return 0
    model = load_model("smollm2-135m", dtype=torch.float32)
    load, started = _load_average(), time.perf_counter()
    torch.set_num_threads(1)
    bandwidth = measure_read_bandwidth(model)
    timed = time_steps(model, probes(model.config.vocab_size), repeats=args.repeats)
    stored = [{"sizes": run.sizes.astype(int).tolist(),
               "seconds": np.round(np.diff(run.ends, prepend=0.0), 6).tolist()} for run in timed]
    fitted = fit_cpu_clock(model.config, [StepTimes.from_seconds(p["sizes"], p["seconds"])
                                          for p in stored], bandwidth_bytes_per_s=bandwidth)
    fitted = dataclasses.replace(fitted, measured={
        **fitted.measured, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": load, "load_average_after": _load_average(),
        "wall_s": round(time.perf_counter() - started, 1), "repeats": args.repeats,
        "probes": stored})
    Path(args.out).write_text(json.dumps(fitted.to_json(), indent=1) + "\n")
    print(f"{fitted.describe()}\nstored in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
