"""Stage 7: serving concurrent traffic under a KV memory budget.

One scheduler for every KV-cache strategy, in the split of vLLM v1 (a scheduler that decides, a KV
cache manager that allocates, a runner that executes), one module per idea, in reading order:

* `request`: `Request` (sizes, arrival, progress), arrival processes (Poisson, speed-up).
* `kv_managers`: reserve-at-admission managers with the scheduler's verbs (`ContiguousManager`,
  stage 2's slabs); the paged ones are `kvlab.paged.KVCacheManager` and
  `kvlab.prefix.PrefixCachingKVCacheManager`, called directly.
* `exact_reservation`: exact-size reservations known in advance, placed first fit in one address
  space (`FirstFitSlabManager`, external fragmentation counted) or in blocks
  (`ExactBlocksManager`): stage 4's fragmentation measurement.
* `scheduler`: `Scheduler` (continuous batching: admit, run, preempt under step budgets).
* `cost_model`: simulation mode's roofline step time on named cards; `calibration`: the same
  derated to published measurements of real engines (the `calibrated` clock), with its residuals.
* `model_runner`: `ModelExecutor` (model mode: one forward pass a step, real cache, sampling).
* `runner`: `engine_step` (decide, execute, record), `serve` (a trace arriving over time),
  `SimulatedExecutor` (cost model).
* `metrics`: concurrency, KV usage, preemptions, TTFT/TPOT percentiles, tokens/s, plots.
* `engine`, `batch`: `LLMEngine` and `generate_batch`, the same scheduler for a batch of prompts
  given up front (n > 1 with copy-on-write, sampling, prefix caching): what stages 4-6 run.

On a GPU, the naive server (no memory manager, one KV tensor per request) running into
`torch.OutOfMemoryError` is a demonstration beside this path: `kvlab.oom_story`.
"""

from .batch import BatchResult, default_pool_size, generate_batch
from .cost_model import CARDS, Card, CostModel, get_card
from .engine import EngineStats, LLMEngine
from .exact_reservation import ExactBlocksManager, FirstFitSlabManager, GapRefusal
from .kv_managers import ContiguousManager, KVManager
from .metrics import ROW_KEYS, ServeResult, StepSeries, format_rows, percentile, plot_memory
from .model_runner import ModelExecutor
from .request import (Request, RequestState, SamplingParams, from_sizes, poisson_arrivals,
                      shrink, speed_up, synthetic_prompt_ids)
from .runner import (STRATEGIES, SimulatedExecutor, StepResult, engine_step, model_strategy,
                     paged_manager, serve, simulated_manager)
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "Request", "RequestState", "SamplingParams", "from_sizes", "poisson_arrivals", "speed_up",
    "shrink", "synthetic_prompt_ids", "KVManager", "ContiguousManager", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Card", "CARDS",
    "get_card", "CostModel", "ModelExecutor", "SimulatedExecutor", "StepResult", "engine_step",
    "serve", "paged_manager", "simulated_manager", "model_strategy", "STRATEGIES", "ServeResult", "StepSeries",
    "ROW_KEYS", "format_rows", "percentile", "plot_memory", "LLMEngine", "EngineStats",
    "BatchResult", "generate_batch", "default_pool_size",
    "FirstFitSlabManager", "ExactBlocksManager", "GapRefusal",
]
