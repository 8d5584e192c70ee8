"""Fitting the calibrated clock (`kvlab.calibration.clock`) to published measurements.

`predict` runs kvlab's own scheduler and cost model at a measurement's configuration; `fit` chooses
the factors that minimise the sum of squared log(predicted / published), a card's efficiencies
pulled towards the shared one (a log-normal prior of 25 %, so a card with one measurement does not
fit it exactly). Under an open workload the schedule depends on the clock, so the fit alternates:
replay at the current factors, recording every step's bytes and FLOPs; fit on those steps
(`levenberg_marquardt`: Gauss-Newton with a numerical Jacobian, numpy only); replay again.
`residuals` reports the fit's error per measurement, which every simulated table quotes as its
error band.

The bandwidth efficiency comes out at its bound, 1 (the sigmoid saturates): every decode step of
a model reads about the same weights, so these measurements cannot separate a slower read from a
larger per-step overhead, and the fit's error still falls as the read speeds up. `--hold-bandwidth`
fits the other factors with the bandwidth held at a given share, to show what that trade costs
(docs/simulation_clock.md).

    python -m kvlab.tools.calibration.fit_clock [--write]   # --write: store it in calibration.json
    python -m kvlab.tools.calibration.fit_clock --hold-bandwidth 0.8
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Sequence

import numpy as np

from kvlab.calibration import clock
from kvlab.calibration.clock import (DATA_FILE, ROOFLINE, Factors, calibration_data,
                                     clock_cost_model, error_band, stored_factors)
from kvlab.config import PRESETS, LlamaConfig, load_config
from kvlab.serving.cost_model import CostModel
from kvlab.serving.engine_core import serve
from kvlab.serving.strategies import simulated_manager
from kvlab.serving.request import Request
from kvlab.workload import from_sizes, poisson_arrivals
from kvlab.serving.scheduler import SchedulerConfig
from kvlab.sizing import default_kv_budget, kv_bytes_per_token
from kvlab.workload import SHAREGPT, synthetic_requests

__all__ = ["Measurement", "Residual", "load_measurements", "predict", "residuals", "fit",
           "levenberg_marquardt", "main"]

PRIOR_SIGMA = 0.25   # a card's efficiency may differ from the shared one by about 25 %
METRICS = ("e2e_s", "ttft_s", "tpot_p50_s", "itl_p50_s", "throughput_tok_s")
UNITS = {"ms": 1e-3, "s": 1.0, "tok/s": 1.0}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One published figure and the configuration it was measured at (see `calibration.json`)."""

    id: str
    source: str
    configuration: str
    model: str
    card: str
    tp: int
    workload: dict
    metric: str
    published: float
    units: str

    @property
    def value(self) -> float:
        """The published figure in seconds (times) or tokens/s (throughput)."""
        return self.published * UNITS[self.units]


@dataclasses.dataclass(frozen=True)
class Residual:
    """A measurement, the calibrated prediction and the error (predicted / published - 1)."""

    measurement: Measurement
    predicted: float
    roofline: float

    @property
    def error(self) -> float:
        return self.predicted / self.measurement.value - 1


def load_measurements() -> list[Measurement]:
    """The published measurements the clock is fitted to."""
    return [Measurement(**entry) for entry in calibration_data()["measurements"]]


def _config(model: str) -> LlamaConfig:
    if model == "llama-2-70b":  # Llama 3's 70B shape with Llama 2's vocabulary and context
        return dataclasses.replace(PRESETS["llama-3.1-70b"], name="llama-2-70b",
                                   vocab_size=32000, max_position_embeddings=4096,
                                   rope_theta=10000.0, rope_scaling=None)
    return load_config(model)


def _manager(kv_budget_bytes: int, bytes_per_token: int, max_model_len: int):
    """The one place this module builds a KV strategy: vLLM's paged pool."""
    return simulated_manager("paged", kv_budget_bytes, bytes_per_token, max_model_len)


def _workload(m: Measurement, config: LlamaConfig
              ) -> tuple[list[Request], SchedulerConfig, int, int]:
    """(requests, step budgets, KV budget bytes per GPU, max_model_len) kvlab replays for a
    measurement."""
    w, per_token = m.workload, kv_bytes_per_token(config, "bf16", m.tp)
    if w["kind"] == "batch":  # a static batch: all prefilled in one step, the pool holds them all
        requests = [Request(i, 0.0, w["prompt_len"], w["output_len"]) for i in range(w["batch"])]
        length = w["prompt_len"] + w["output_len"]
        budget = w["batch"] * (length + 16) * per_token
        return (requests, SchedulerConfig(w["batch"], max(8192, w["batch"] * w["prompt_len"])),
                budget, length)
    if w["kind"] != "sharegpt":
        raise ValueError(f"{m.id}: unknown workload kind {w['kind']!r}")
    rows = [row for row in synthetic_requests(w["num_prompts"], SHAREGPT, seed=0)
            if row.total_len <= 4096]
    requests = from_sizes(rows)
    if w["rate"] is not None:
        requests = poisson_arrivals(requests, w["rate"], seed=0)
    budget = default_kv_budget(config, m.card, dtype="bf16", tp=m.tp)
    return requests, SchedulerConfig(256, 8192), budget, 4096


class _RecordingExecutor:
    """The cost model's clock, with every step's sizes kept for `_Recording.retime`."""

    def __init__(self, cost: CostModel):
        self.cost, self.sizes, self.decode_tokens = cost, [], []

    def execute(self, output):
        sizes = self.cost.step_sizes(output.scheduled)
        self.sizes.append(sizes)
        # tokens after a request's first: it computes its last token and has an output already
        self.decode_tokens.append(sum(
            1 for r, n in output.scheduled
            if r.num_computed_tokens + n == r.num_tokens and r.num_output_tokens > 0))
        return None, self.cost.step_time(*sizes)

    def release(self, request):
        pass


@dataclasses.dataclass
class _Recording:
    """One replay's steps (sizes, which followed an idle wait) and when each request's first and
    last tokens came (step indices): enough to re-time the same decisions on another clock."""

    measurement: Measurement
    config: LlamaConfig
    sizes: np.ndarray          # (steps, 4): tokens, cached tokens read, pairs, rows sampled
    wake_s: np.ndarray         # a step's start if it followed an idle wait, else -inf
    decode_tokens: np.ndarray  # tokens after a request's first, per step
    arrival_s: np.ndarray
    first_step: np.ndarray
    finish_step: np.ndarray
    outputs: np.ndarray

    def step_times(self, factors: Factors) -> np.ndarray:
        m = self.measurement
        cost = clock_cost_model(self.config, m.card, m.tp, factors=factors)
        tokens, kv, pairs, sampled = self.sizes.T
        moved, flops = cost.step_work(tokens, kv, pairs, sampled)
        return cost.time_of_work(moved, flops, tokens, np.maximum)

    def retime(self, factors: Factors) -> float:
        """The measurement's metric for these decisions at `factors`' clock."""
        times = self.step_times(factors)
        done = np.cumsum(times)
        # end_k = max over steps j <= k that could start no earlier than wake_j of
        # wake_j + (time of steps j..k): the idle waits stay, the busy stretches stretch.
        before = np.concatenate(([0.0], done[:-1]))
        end = done + np.maximum.accumulate(self.wake_s - before)
        metric = self.measurement.metric
        start = self.arrival_s.min()
        if metric == "e2e_s":
            return float(end[self.finish_step].max() - start)
        if metric == "ttft_s":
            return float(np.percentile(end[self.first_step] - self.arrival_s, 50))
        if metric == "tpot_p50_s":
            many = self.outputs > 1
            return float(np.percentile((end[self.finish_step] - end[self.first_step])[many]
                                       / (self.outputs[many] - 1), 50))
        if metric == "itl_p50_s":
            return float(np.percentile(np.repeat(times, self.decode_tokens), 50))
        if metric == "throughput_tok_s":
            return float(self.outputs.sum() / (end[self.finish_step].max() - start))
        raise ValueError(f"{self.measurement.id}: unknown metric {metric!r}; one of {METRICS}")


def _record(m: Measurement, factors: Factors) -> _Recording:
    """Replay a measurement's configuration through kvlab's scheduler at `factors`' clock."""
    config = _config(m.model)
    requests, scheduler, budget, max_model_len = _workload(m, config)
    executor = _RecordingExecutor(clock_cost_model(config, m.card, m.tp, factors=factors))
    per_token = kv_bytes_per_token(config, "bf16", m.tp)
    result = serve(requests, _manager(budget, per_token, max_model_len), executor, scheduler, per_token,
                   progress=False)
    ends = np.array(result.series.time_s)
    starts = ends - np.array(result.series.duration_s)
    idle = np.concatenate(([True], starts[1:] > ends[:-1] * (1 + 1e-12)))
    done = [r for r in result.served_requests if r.finish_s is not None]
    return _Recording(m, config, np.array(executor.sizes, dtype=np.float64),
                      np.where(idle, starts, -np.inf), np.array(executor.decode_tokens),
                      np.array([r.arrival_s for r in done]),
                      np.searchsorted(ends, [r.first_token_s for r in done]),
                      np.searchsorted(ends, [r.finish_s for r in done]),
                      np.array([r.num_output_tokens for r in done], dtype=np.float64))


def predict(m: Measurement, factors: Factors | None = None) -> float:
    """kvlab's figure for a measurement's configuration at a clock (default: the stored fit;
    `ROOFLINE` for the roofline), in seconds or tokens/s."""
    factors = stored_factors() if factors is None else factors
    return _record(m, factors).retime(factors)


def residuals(factors: Factors | None = None,
              measurements: Sequence[Measurement] | None = None) -> list[Residual]:
    """Every measurement with its calibrated and roofline predictions (default: stored fit)."""
    factors = stored_factors() if factors is None else factors
    return [Residual(m, predict(m, factors), predict(m, ROOFLINE))
            for m in (load_measurements() if measurements is None else measurements)]


def _sigmoid(x: float) -> float:
    return float(1 / (1 + math.exp(-x)))


def _unpack(theta: np.ndarray, cards: list[str], held_bandwidth: float | None = None) -> Factors:
    """theta: logit shared compute and bandwidth efficiencies, per-card logit offsets of each,
    log step overhead, log all-reduce latency; with held_bandwidth, no bandwidth terms (every card
    gets that share)."""
    sigmoid, k = _sigmoid, len(cards)
    compute = {c: sigmoid(theta[0] + theta[2 + i]) for i, c in enumerate(cards)}
    if held_bandwidth is None:
        bandwidth = {c: sigmoid(theta[1] + theta[2 + k + i]) for i, c in enumerate(cards)}
        shared_bandwidth = sigmoid(theta[1])
    else:
        bandwidth, shared_bandwidth = dict.fromkeys(cards, held_bandwidth), held_bandwidth
    return Factors(compute, bandwidth, sigmoid(theta[0]), shared_bandwidth,
                   math.exp(theta[-2]), math.exp(theta[-1]))


def _objective(theta, recordings, cards, held_bandwidth=None) -> np.ndarray:
    """Log errors of every measurement, then the prior's terms for the per-card offsets."""
    factors = _unpack(theta, cards, held_bandwidth)
    errors = [math.log(r.retime(factors) / r.measurement.value) for r in recordings]
    return np.concatenate((errors, theta[2:-2] / PRIOR_SIGMA))


def levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], theta: np.ndarray,
                        iterations: int = 30) -> np.ndarray:
    """The parameters near `theta` that minimise sum(residuals(theta) ** 2): Gauss-Newton steps
    with a numerical Jacobian, damped until each step lowers the cost (numpy only)."""
    lam = 1e-3
    cost = np.sum(residuals(theta) ** 2)
    for _ in range(iterations):
        r = residuals(theta)
        jac = np.empty((len(r), len(theta)))
        for j in range(len(theta)):
            step = np.zeros_like(theta)
            step[j] = 1e-5
            jac[:, j] = (residuals(theta + step) - r) / 1e-5
        while True:  # Levenberg-Marquardt: damp until the step lowers the cost
            a = jac.T @ jac
            delta = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -jac.T @ r)
            new = np.sum(residuals(theta + delta) ** 2)
            if new < cost:
                theta, cost, lam = theta + delta, new, lam / 3
                break
            lam *= 10
            if lam > 1e8:
                return theta
        if np.max(np.abs(delta)) < 1e-6:
            break
    return theta


def fit(measurements: Sequence[Measurement] | None = None, rounds: int = 3,
        held_bandwidth: float | None = None) -> Factors:
    """Fit the factors to the measurements (default: all); see the module docstring.
    held_bandwidth: hold every card's bandwidth efficiency at this share, fitting the others.

    Raises:
        ValueError: held_bandwidth outside (0, 1].
    """
    if held_bandwidth is not None and not 0 < held_bandwidth <= 1:
        raise ValueError(f"held_bandwidth must be a share of peak in (0, 1], got {held_bandwidth}")
    measurements = load_measurements() if measurements is None else list(measurements)
    cards = sorted({m.card for m in measurements})
    bandwidth_terms = 0 if held_bandwidth is not None else len(cards)
    # theta[1], the shared bandwidth logit, stays in place (and unused) when the bandwidth is held,
    # so the layout of `_unpack` holds either way.
    theta = np.concatenate(([1.0, 1.0], np.zeros(len(cards) + bandwidth_terms),
                            [math.log(1e-3), math.log(1e-5)]))
    free = np.ones(len(theta), dtype=bool)
    if held_bandwidth is not None:
        free[1] = False
    factors = ROOFLINE if held_bandwidth is None else dataclasses.replace(
        ROOFLINE, shared_bandwidth_efficiency=held_bandwidth)
    for _ in range(rounds):
        recordings = [_record(m, factors) for m in measurements]

        def objective(t, recordings=recordings):
            full = theta.copy()
            full[free] = t
            return _objective(full, recordings, cards, held_bandwidth)

        theta[free] = levenberg_marquardt(objective, theta[free])
        factors = _unpack(theta, cards, held_bandwidth)
    return factors


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvlab.tools.calibration.fit_clock [--write]`: fit, print the residuals (and
    store)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", action="store_true", help=f"store the fit in {DATA_FILE}")
    parser.add_argument("--hold-bandwidth", type=float, metavar="SHARE", default=None,
                        help="hold the bandwidth efficiency at this share of peak (0-1] and "
                             "fit the other factors (not with --write: the stored clock is the "
                             "free fit)")
    args = parser.parse_args(argv)
    if args.write and args.hold_bandwidth is not None:
        parser.error("--hold-bandwidth shows what holding the bandwidth costs; --write stores the "
                     "free fit only")
    factors = fit(held_bandwidth=args.hold_bandwidth)
    rows = residuals(factors)
    print(json.dumps(dataclasses.asdict(factors), indent=1))
    print("| measurement | published | roofline | calibrated | error |\n|---|---|---|---|---|")
    for r in rows:  # the docs' table, in Markdown
        scale, m = 1 / UNITS[r.measurement.units], r.measurement
        print(f"| {m.configuration} | {m.published:,.4g} {m.units} | {r.roofline * scale:,.4g} | "
              f"{r.predicted * scale:,.4g} | {r.error:+.0%} |")
    print("clock: calibrated (fit residuals " + error_band([r.error for r in rows]) + ")")
    log_errors = np.log([r.predicted / r.measurement.value for r in rows])
    print(f"sum of squared log errors {np.sum(log_errors ** 2):.3f}, root mean square "
          f"{np.sqrt(np.mean(log_errors ** 2)):.3f}")
    print("roofline: " + error_band([r.roofline / r.measurement.value - 1 for r in rows]))
    if args.write:
        path = Path(clock.__file__).with_name(DATA_FILE)  # the data file kvlab ships
        data = json.loads(path.read_text())
        data["fitted"] = {
            "factors": dataclasses.asdict(factors),
            "errors": {r.measurement.id: round(r.error, 4) for r in rows},
            "roofline_errors": {r.measurement.id: round(r.roofline / r.measurement.value - 1, 4)
                                for r in rows}}
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
