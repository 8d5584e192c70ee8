"""Stage 7: serving concurrent traffic under a KV memory budget.

One scheduler for every KV-cache strategy, in the split of vLLM v1 (a scheduler that decides, a KV
cache manager that allocates, a runner that executes), one module per idea, in reading order:

* `request`: `Request` (sizes, arrival, progress), arrival processes (Poisson, speed-up).
* `kv_managers`: the `KVManager` interface and its strategies (contiguous reservation, paged).
* `scheduler`: `Scheduler` (continuous batching: admit, run, preempt under step budgets).
* `cost_model`: simulation mode's roofline step time on named cards.
* `runner`: `serve` (the loop), `ModelExecutor` (real model), `SimulatedExecutor` (cost model).
* `metrics`: concurrency, KV usage, preemptions, TTFT/TPOT percentiles, tokens/s, plots.
"""

from .cost_model import CARDS, Card, CostModel, get_card
from .kv_managers import ContiguousManager, KVManager, PagedManager
from .metrics import ROW_KEYS, ServeResult, StepSeries, format_rows, percentile, plot_memory
from .request import (Request, RequestState, from_sizes, poisson_arrivals, shrink, speed_up,
                      synthetic_prompt_ids)
from .runner import (STRATEGIES, ModelExecutor, SimulatedExecutor, model_strategy, serve,
                     simulated_manager)
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "Request", "RequestState", "from_sizes", "poisson_arrivals", "speed_up", "shrink",
    "synthetic_prompt_ids", "KVManager", "ContiguousManager", "PagedManager", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "Card", "CARDS", "get_card", "CostModel",
    "ModelExecutor", "SimulatedExecutor", "serve", "simulated_manager", "model_strategy",
    "STRATEGIES", "ServeResult", "StepSeries", "ROW_KEYS", "format_rows", "percentile",
    "plot_memory",
]
