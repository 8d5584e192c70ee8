"""What a replay measured, per strategy: concurrency, memory, preemptions, latency, throughput.

Definitions (all times in seconds on the replay's clock: the cost model's in simulation, the
wall clock in model mode unless a cost model is given):

* running: requests holding KV memory during a step; peak, and mean weighted by step duration.
* kv_usage ("reserved / pool" in tables): token slots reserved / token slots in the budget (vLLM's
  `kv_cache_usage`), time-weighted mean and peak: how full the pool is, not how well it is used
  (a contiguous slab of max_model_len slots counts whole from admission on).
* kv_states_share ("states / reserved"): slot-seconds holding a computed K/V (the step's own
  included) over slot-seconds reserved: the measure of the vLLM paper's figure 2 (Kwon et al.,
  SOSP 2023: 20.4-38.2 % for Orca's reservations, 96.3 % for vLLM). A slot several requests
  share (a prefix block) holds one K/V and counts once, as it does in what is reserved, so the
  share is at most 100 % (`engine_core.shared_tokens`).
* TTFT (time to first token) = first token time - arrival time; TPOT (time per output token) =
  (finish - first token) / (output tokens - 1), for requests with more than one output token.
  Percentiles are `kvlab.workload.percentile`'s: linear between order statistics (numpy's default).
* output_tokens_per_s = output tokens of finished requests / (last finish - first arrival).
* prefix_hit_rate ("prefix hit") = tokens found in the prefix cache / tokens looked up, at first
  admissions: the prefix cache hit rate as vLLM v1 counts it (`prefix_cache_hits` /
  `prefix_cache_queries`); readmitted_hit_rate ("re-admit hit"), the same at re-admissions after
  a preemption (vLLM's `preempted_hits` / `preempted_queries`, which its rate leaves out: a
  re-admitted request mostly finds its own blocks, cached since its preemption freed them). None
  for a strategy without a prefix cache, and readmitted_hit_rate None when nothing was re-admitted
  (`kvlab.serving.scheduler`).
* events_per_s = (request, step) pairs processed per second of replay wall time: the simulator's speed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from ..workload import percentile
from .request import Request

__all__ = ["percentile", "StepSeries", "ServeResult", "summarize", "ROW_KEYS", "format_rows",
           "HIT_NOTE", "plot_memory"]


@dataclasses.dataclass
class StepSeries:
    """Per step: end time and duration (s), requests running and waiting, slots reserved, held."""

    time_s: list[float] = dataclasses.field(default_factory=list)
    duration_s: list[float] = dataclasses.field(default_factory=list)
    running: list[int] = dataclasses.field(default_factory=list)
    waiting: list[int] = dataclasses.field(default_factory=list)
    reserved_tokens: list[int] = dataclasses.field(default_factory=list)
    used_tokens: list[int] = dataclasses.field(default_factory=list)

    def record(self, end_s: float, duration_s: float, running: int, waiting: int, reserved: int,
               used: int) -> None:
        self.time_s.append(end_s)
        self.duration_s.append(duration_s)
        self.running.append(running)
        self.waiting.append(waiting)
        self.reserved_tokens.append(reserved)
        self.used_tokens.append(used)

    def time_mean(self, values: Sequence[float]) -> float:
        total = sum(self.duration_s)
        if total == 0:
            return float(sum(values) / len(values)) if values else 0.0
        return sum(v * d for v, d in zip(values, self.duration_s)) / total


# The keys of one row of `kvlab serve`, in print order.
ROW_KEYS = ("strategy", "requests", "finished", "rejected", "peak_running", "mean_running",
            "preemptions", "kv_usage_mean", "kv_usage_peak", "kv_states_share",
            "output_tokens_per_s", "ttft_p50_s",
            "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "prefix_hit_rate", "readmitted_hit_rate")


@dataclasses.dataclass
class ServeResult:
    """One strategy's figures on one workload (see the module docstring); memory in tokens."""

    strategy: str
    requests: int
    finished: int
    rejected: int
    peak_running: int
    mean_running: float
    preemptions: int
    recomputed_tokens: int
    kv_usage_mean: float
    kv_usage_peak: float
    kv_states_share: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    prefix_hit_rate: float | None
    readmitted_hit_rate: float | None
    # tokens hit and looked up, at first admissions and re-admissions (hits None: no prefix cache)
    prefix_hit_tokens: int | None
    prefix_queried_tokens: int
    readmitted_hit_tokens: int | None
    readmitted_queried_tokens: int
    duration_s: float
    num_steps: int
    capacity_tokens: int
    bytes_per_token: int
    wall_s: float
    events_per_s: float
    reject_examples: list[str]
    series: StepSeries = dataclasses.field(repr=False)
    served_requests: list[Request] = dataclasses.field(repr=False, default_factory=list)

    def row(self) -> dict:
        """The `kvlab serve` row: ROW_KEYS plus the replay's size and speed."""
        out = {key: getattr(self, key) for key in ROW_KEYS}
        out.update(recomputed_tokens=self.recomputed_tokens, output_tokens=self.output_tokens,
                   prefix_hit_tokens=self.prefix_hit_tokens,
                   prefix_queried_tokens=self.prefix_queried_tokens,
                   readmitted_hit_tokens=self.readmitted_hit_tokens,
                   readmitted_queried_tokens=self.readmitted_queried_tokens,
                   duration_s=self.duration_s, num_steps=self.num_steps,
                   capacity_tokens=self.capacity_tokens, bytes_per_token=self.bytes_per_token,
                   wall_s=self.wall_s, events_per_s=self.events_per_s,
                   reject_examples=self.reject_examples)
        return out


def summarize(strategy: str, requests: Sequence[Request], series: StepSeries, preemptions: int,
              recomputed_tokens: int, hit_tokens: int | None, queried_tokens: int,
              capacity_tokens: int, bytes_per_token: int, wall_s: float,
              events: int, readmitted_hit_tokens: int | None = None,
              readmitted_queried_tokens: int = 0) -> ServeResult:
    """Turn a finished replay (its requests, after serving, and its step series) into figures.
    hit_tokens, queried_tokens: at first admissions; readmitted_*: at re-admissions after a
    preemption (hit tokens None: the strategy has no prefix cache)."""
    finished = [r for r in requests if r.finish_s is not None]
    rejected = [r for r in requests if r.reject_reason is not None]
    ttft = [r.first_token_s - r.arrival_s for r in finished]
    tpot = [(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
            for r in finished if r.num_output_tokens > 1]
    output_tokens = sum(r.num_output_tokens for r in finished)
    start = min((r.arrival_s for r in requests), default=0.0)
    end = max((r.finish_s for r in finished), default=start)
    usage = [reserved / capacity_tokens for reserved in series.reserved_tokens]
    reserved_s = sum(r * d for r, d in zip(series.reserved_tokens, series.duration_s))
    states_s = sum(u * d for u, d in zip(series.used_tokens, series.duration_s))
    hit_rate = None if hit_tokens is None else (hit_tokens / queried_tokens
                                                if queried_tokens else 0.0)
    readmitted_rate = (None if readmitted_hit_tokens is None or not readmitted_queried_tokens
                       else readmitted_hit_tokens / readmitted_queried_tokens)
    return ServeResult(
        strategy=strategy, requests=len(requests), finished=len(finished), rejected=len(rejected),
        peak_running=max(series.running, default=0),
        mean_running=series.time_mean(series.running), preemptions=preemptions,
        recomputed_tokens=recomputed_tokens, kv_usage_mean=series.time_mean(usage),
        kv_usage_peak=max(usage, default=0.0),
        kv_states_share=states_s / reserved_s if reserved_s else 0.0, output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / (end - start) if end > start else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        prefix_hit_rate=hit_rate, readmitted_hit_rate=readmitted_rate,
        prefix_hit_tokens=hit_tokens, prefix_queried_tokens=queried_tokens,
        readmitted_hit_tokens=readmitted_hit_tokens,
        readmitted_queried_tokens=readmitted_queried_tokens,
        duration_s=end - start, num_steps=len(series.time_s),
        capacity_tokens=capacity_tokens, bytes_per_token=bytes_per_token, wall_s=wall_s,
        events_per_s=events / wall_s if wall_s > 0 else 0.0,
        reject_examples=[f"request {r.request_id}: {r.reject_reason}" for r in rejected[:3]],
        series=series, served_requests=list(requests))


# The footnote of a table with a prefix cache row (`kvlab serve` prints it under the table).
HIT_NOTE = ("prefix hit: tokens found cached at first admissions (vLLM's prefix cache hit rate); "
            "re-admit hit: the same for requests back after a preemption, which mostly find "
            "their own blocks (vLLM counts them apart)")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_rows(results: Sequence[ServeResult]) -> str:
    """A plain-text table, a row per strategy, ratios in % (column names: the module docstring)."""
    headers = ("strategy", "finished", "rejected", "peak run", "mean run", "preempt",
               "reserved/pool mean", "reserved/pool peak", "states/reserved", "out tok/s",
               "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "prefix hit", "re-admit hit")
    lines = []
    for r in results:
        percent = [None if v is None else f"{v:.1%}" for v in
                   (r.kv_usage_mean, r.kv_usage_peak, r.kv_states_share, r.prefix_hit_rate,
                    r.readmitted_hit_rate)]
        lines.append([r.strategy, _cell(r.finished), _cell(r.rejected), _cell(r.peak_running),
                      _cell(r.mean_running), _cell(r.preemptions), *map(_cell, percent[:3]),
                      _cell(r.output_tokens_per_s),
                      *(_cell(v) + ("" if v is None or math.isnan(v) else " s") for v in
                        (r.ttft_p50_s, r.ttft_p99_s, r.tpot_p50_s, r.tpot_p99_s)),
                      _cell(percent[3]), _cell(percent[4])])
    widths = [max(len(str(row[i])) for row in [headers, *lines]) for i in range(len(headers))]
    table = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in [headers, *lines]]
    table.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(table)


# One dash pattern per strategy, so lines that coincide stay visible (see plot_memory).
LINE_STYLES = ("-", "--", ":", "-.")


def plot_memory(results: Sequence[ServeResult], axes=None, max_points: int = 2000):
    """KV memory held (% of the budget) and running requests over time, one line per strategy,
    on two axes (given, or a new figure; returned), at most `max_points` steps (every k-th) a line.
    A strategy whose lines equal an earlier one's is labelled "(same as <earlier>)"."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    drawn = []  # (strategy, curves) of the lines drawn so far
    for i, r in enumerate(results):
        s = r.series
        every = max(1, len(s.time_s) // max_points)
        times = s.time_s[::every]
        held = [100 * t / r.capacity_tokens for t in s.reserved_tokens[::every]]
        running = s.running[::every]
        # Two strategies can decide alike (a prefix cache with no hits is paging): say so.
        same_as = next((name for name, curves in drawn if curves == (times, held, running)), None)
        label = r.strategy if same_as is None else f"{r.strategy} (same as {same_as})"
        style = dict(ls=LINE_STYLES[i % len(LINE_STYLES)], lw=1 if i == 0 else 1.5, label=label)
        axes[0].plot(times, held, **style)
        axes[1].plot(times, running, **style)
        drawn.append((r.strategy, (times, held, running)))
    axes[0].set_ylabel("KV held (% of budget)")
    axes[1].set_ylabel("running requests")
    axes[1].set_xlabel("time (s)")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    return axes
