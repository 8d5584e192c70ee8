"""How many requests a KV budget really holds: the one scheduler with the pool kept full.

`kvlab report` divides the budget by what an average in-flight request reserves: exact for stage
2's slabs, a steady-state estimate for paging (`kvlab.report` says why). Here it is measured: every
request is queued at once, so someone always waits and the scheduler admits until the KV manager
says no; the requests running at those steps are what the budget holds (`max_num_seqs` is the
workload's size, so memory is the only limit). No time is modelled: with every request waiting
from the start, no decision depends on the clock. `kvlab report --measure` prints the result.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from .serving.engine_core import serve
from .serving.strategies import simulated_manager
from .workload import from_sizes
from .serving.scheduler import SchedulerConfig, SchedulerOutput

__all__ = ["HeldMeasurement", "measure_requests_held"]


@dataclasses.dataclass(frozen=True)
class HeldMeasurement:
    """Requests running while others waited (mean, peak); num_steps 0: all fit at once, no limit."""

    mean: float
    peak: int
    num_steps: int


class _UnitClock:
    """An executor that runs nothing and counts each step as 1 s (only decisions matter here)."""

    def execute(self, output: SchedulerOutput) -> tuple[None, float]:
        return None, 1.0

    def release(self, request) -> None:
        pass


def measure_requests_held(sizes: Iterable, strategy: str, kv_budget_bytes: int,
                          bytes_per_token: int, max_model_len: int, block_size: int = 16,
                          max_num_batched_tokens: int = 8192) -> HeldMeasurement:
    """Queue every row of `sizes` (`kvlab.workload.Request`s) at once through `strategy`
    (`kvlab.serving.STRATEGIES`), rejecting those over max_model_len. ValueError: an unknown
    strategy, a budget below one max_model_len request, or no request that fits."""
    requests = from_sizes(sizes)
    for request in requests:
        request.arrival_s = 0.0  # all queued at once: the pool stays full while any wait
    if not any(r.total_len <= max_model_len for r in requests):
        raise ValueError(f"no request of the workload fits max_model_len={max_model_len:,}")
    manager = simulated_manager(strategy, kv_budget_bytes, bytes_per_token, max_model_len,
                                block_size)
    config = SchedulerConfig(max_num_seqs=len(requests),
                             max_num_batched_tokens=max_num_batched_tokens)
    series = serve(requests, manager, _UnitClock(), config).series
    limited = [running for running, waiting in zip(series.running, series.waiting) if waiting]
    if not limited:  # everything fit at once: the workload, not the budget, set the concurrency
        return HeldMeasurement(sum(series.running) / len(series.running), max(series.running), 0)
    return HeldMeasurement(sum(limited) / len(limited), max(limited), len(limited))
