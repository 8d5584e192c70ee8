"""Stage 7: serving concurrent traffic under a KV memory budget.

One scheduler for every KV-cache strategy, in the split of vLLM v1 (a scheduler that decides, a KV
cache manager that allocates, a runner that executes), one module per idea, in reading order:

* `request`: `Request` (sizes, arrival, progress); a trace's requests come from
  `kvlab.workload.from_sizes` (arrival processes: Poisson, speed-up; shrink; synthetic ids).
* `reservation`: reserve at admission, one `KVManager` base with the scheduler's verbs and its
  placements: max_model_len slabs (`ContiguousManager`, stage 2), exact sizes first fit in one
  address space (`FirstFitSlabManager`, external fragmentation counted) or in blocks
  (`ExactBlocksManager`): stage 4's fragmentation measurement. The paged managers are
  `kvlab.paged.KVCacheManager` and `kvlab.prefix.PrefixCachingKVCacheManager`, called directly.
* `scheduler`: `Scheduler` (continuous batching: admit, run, preempt under step budgets).
* `cost_model`: simulation mode's roofline step time on named cards (the `calibrated` clock
  derates it to published measurements: `kvlab.calibration`).
* `model_runner`: `ModelRunner` (model mode: one forward pass a step, real cache, sampling).
* `engine_core`: `engine_step` (decide, execute, record), `serve` (a trace arriving over time),
  `SimulatedExecutor` (cost model).
* `strategies`: the one strategy factory (`STRATEGIES`, `simulated_manager`, `model_strategy`).
* `metrics`: concurrency, KV usage, preemptions, TTFT/TPOT percentiles, tokens/s, plots.
* `llm_engine`: `LLMEngine` and `generate_batch`, the same scheduler for a batch of prompts
  given up front (n > 1 with copy-on-write, sampling, prefix caching): what stages 4-6 run.

Beside this path, in the packages that own them: traces by name or file (`kvlab.traces.load_trace`),
`kvlab report --measure`'s requests held (`kvlab.report_capacity`), the clock's fit
(`kvlab.calibration`) and, on a GPU, the naive server (one KV tensor per request) running into
`torch.OutOfMemoryError` (`kvlab.tools.oom_story`).
"""

from ..sampling import SamplingParams
from ..workload import from_sizes, poisson_arrivals, shrink, speed_up, synthetic_prompt_ids
from .cost_model import CARDS, Card, CostModel, get_card
from .engine_core import SimulatedExecutor, StepResult, engine_step, serve
from .llm_engine import BatchResult, EngineStats, LLMEngine, default_pool_size, generate_batch
from .metrics import ROW_KEYS, ServeResult, StepSeries, format_rows, percentile, plot_memory
from .model_runner import ModelRunner
from .reservation import (ContiguousManager, ExactBlocksManager, FirstFitSlabManager, GapRefusal,
                          KVManager)
from .request import Request, RequestState
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .strategies import STRATEGIES, model_strategy, simulated_manager

__all__ = [
    "Request", "RequestState", "SamplingParams", "from_sizes", "poisson_arrivals", "speed_up",
    "shrink", "synthetic_prompt_ids", "KVManager", "ContiguousManager", "FirstFitSlabManager",
    "ExactBlocksManager", "GapRefusal", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Card",
    "CARDS", "get_card", "CostModel", "ModelRunner", "SimulatedExecutor", "StepResult",
    "engine_step", "serve", "simulated_manager", "model_strategy", "STRATEGIES", "ServeResult",
    "StepSeries", "ROW_KEYS", "format_rows", "percentile", "plot_memory", "LLMEngine",
    "EngineStats", "BatchResult", "generate_batch", "default_pool_size",
]
