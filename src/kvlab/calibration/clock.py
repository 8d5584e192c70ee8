"""The calibrated clock: the roofline derated to what real engines were measured to do.

The roofline (`cost_model`) is a lower bound: published measurements of vLLM, TensorRT-LLM and
SGLang on the same cards run 1.2-3.3x slower (issue 20 collected them). Four kinds of factor close
most of that gap, each a physical effect the roofline leaves out:

* compute efficiency (per card): the share of peak FLOP/s a long prefill reaches;
* bandwidth efficiency (per card): the share of peak HBM bandwidth a decode step reaches;
* a per-step overhead (shared): scheduling, sampling, kernel launches, Python;
* an all-reduce latency (shared): each of the 2 x layers tensor-parallel all-reduces of a step.

The bandwidth efficiency comes out at its bound, 100 % of the datasheet's peak, which no real
decode step reaches: every decode step of a model reads about the same weights, so the 22
measurements cannot tell a slower read from a larger per-step overhead, and the fit's error still
falls as the read speeds up. Read the two together: the per-step overhead holds decode's shortfall
from the datasheet bandwidth as well. Every line that prints this clock says so (`BOUND_NOTE`);
docs/simulation_clock.md gives the fit with the bandwidth held lower (`fit_clock
--hold-bandwidth`).

The measurements are data (`calibration.json`, shipped with the package): source, configuration,
published figure and units, and the workload kvlab replays for it; so are the factors fitted to
them and each measurement's error at that fit, which every simulated table quotes as its error
band (`clock_note`). Fitting them is measurement tooling beside the course
(`kvlab.tools.calibration.fit_clock`, `python -m kvlab.tools.calibration.fit_clock --write`).
`describe_card` and `describe_clock` print a cost model's card and clock, a line each.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
from typing import Sequence

from ..config import LlamaConfig
from ..gpus import get_card
from ..serving.cost_model import CostModel

__all__ = ["Factors", "calibration_data", "stored_factors", "clock_cost_model", "error_band",
           "clock_note", "describe_card", "describe_clock", "CLOCKS", "ROOFLINE", "BOUND_NOTE"]

CLOCKS = ("roofline", "calibrated")
DATA_FILE = "calibration.json"
# What a bandwidth efficiency at its bound of 1 means (module docstring): said wherever it is shown.
BOUND_NOTE = ("bandwidth at the fit's bound of 100 %: the measurements do not separate a slower "
              "read from the per-step overhead")


@dataclasses.dataclass(frozen=True)
class Factors:
    """The calibrated clock's parameters (all 1 and 0: the roofline)."""

    compute_efficiency: dict[str, float]
    bandwidth_efficiency: dict[str, float]
    shared_compute_efficiency: float = 1.0
    shared_bandwidth_efficiency: float = 1.0
    step_overhead_s: float = 0.0
    allreduce_latency_s: float = 0.0

    def efficiencies(self, card: str) -> tuple[float, float]:
        """(compute, bandwidth) efficiency of a card; the shared ones for a card not measured."""
        return (self.compute_efficiency.get(card, self.shared_compute_efficiency),
                self.bandwidth_efficiency.get(card, self.shared_bandwidth_efficiency))


ROOFLINE = Factors({}, {})


@functools.lru_cache(maxsize=1)
def calibration_data() -> dict:
    """`calibration.json`: the measurements, the fitted factors and each measurement's error."""
    return json.loads(importlib.resources.files(__package__).joinpath(DATA_FILE).read_text())


def stored_factors() -> Factors:
    """The factors `python -m kvlab.tools.calibration.fit_clock --write` fitted (from the data
    file).

    Raises:
        RuntimeError: the data file holds no fit yet.
    """
    fitted = calibration_data()["fitted"]
    if fitted is None:
        raise RuntimeError(f"{DATA_FILE} holds no fit; run python -m "
                           f"kvlab.tools.calibration.fit_clock --write")
    return Factors(**fitted["factors"])


def clock_cost_model(config: LlamaConfig, card_name: str, tp: int = 1, dtype: str = "bf16",
                     clock: str = "calibrated", factors: Factors | None = None) -> CostModel:
    """The cost model of one clock: 'roofline' (the lower bound) or 'calibrated' (`factors`,
    default the stored fit).

    Raises:
        ValueError: unknown clock.
    """
    card = get_card(card_name)
    if clock == "roofline":
        return CostModel(config, card, tp, dtype)
    if clock != "calibrated":
        raise ValueError(f"unknown clock {clock!r}; choose from {', '.join(CLOCKS)}")
    factors = stored_factors() if factors is None else factors
    compute, bandwidth = factors.efficiencies(card.name)
    link = calibration_data()["interconnect_gb_s"].get(card.name)
    return CostModel(config, card, tp, dtype, step_overhead_s=factors.step_overhead_s,
                     compute_efficiency=compute, bandwidth_efficiency=bandwidth,
                     allreduce_latency_s=factors.allreduce_latency_s,
                     link_bytes_per_s=None if link is None else link * 1e9, clock="calibrated")


def error_band(errors: Sequence[float]) -> str:
    """'−18 % … +22 % over 17 published measurements' (errors: predicted / published - 1)."""
    low, high = (f"{100 * e:+.0f} %".replace("-", "\N{MINUS SIGN}")
                 for e in (min(errors), max(errors)))
    return f"{low} \N{HORIZONTAL ELLIPSIS} {high} over {len(errors)} published measurements"


def _at_bound(bandwidth_efficiency: float) -> bool:
    """The fitted share prints as 100.0 %: the fit ran to its bound."""
    return bandwidth_efficiency >= 0.9995


def clock_note(clock: str) -> str:
    """The line under a simulated table: which clock, and its measured error band (stored); for
    the calibrated clock with its bandwidth at the fit's bound, `BOUND_NOTE`."""
    fitted = calibration_data()["fitted"]
    if clock == "roofline":
        return (f"clock: roofline, a lower bound (errors "
                f"{error_band(list(fitted['roofline_errors'].values()))})")
    bound = f"; {BOUND_NOTE}" if _at_bound(stored_factors().shared_bandwidth_efficiency) else ""
    return f"clock: calibrated (fit residuals {error_band(list(fitted['errors'].values()))}{bound})"


def describe_card(cost: CostModel) -> str:
    """One line naming the card, tp and what a step costs at minimum (on the roofline)."""
    card = cost.card
    return (f"{cost.tp} x {card.name} ({card.bandwidth_bytes_per_s / 1e12:g} TB/s, "
            f"{card.flops_per_s / 1e12:g} dense TFLOP/s each), {cost.config.name} {cost.dtype}: "
            f"weights {cost.weights_bytes / 1e9:.1f} GB per GPU, so a step takes >= "
            f"{cost.weights_bytes / card.bandwidth_bytes_per_s * 1e3:.2f} ms")


def describe_clock(cost: CostModel) -> str:
    """One line: the clock's name and, off the roofline, its derating factors."""
    if cost.clock == "roofline":
        return "clock: roofline (100 % of peak bandwidth and FLOP/s, no overheads)"
    bandwidth = cost.bandwidth / cost.card.bandwidth_bytes_per_s
    bound = " (the fit's bound)" if cost.clock == "calibrated" and _at_bound(bandwidth) else ""
    line = (f"clock: {cost.clock}: {100 * cost.flops / cost.card.flops_per_s:.1f} % of peak "
            f"FLOP/s, {100 * bandwidth:.1f} % of peak bandwidth{bound}, "
            f"+{cost.step_overhead_s * 1e3:.2f} ms a step")
    if cost.tp > 1:
        line += (f", +{cost.allreduce_latency_s * 1e6:.1f} \N{MICRO SIGN}s for each of "
                 f"{2 * cost.config.num_hidden_layers} all-reduces a step")
    return line
