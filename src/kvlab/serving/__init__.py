"""Stage 7: serving concurrent traffic under a KV memory budget.

One scheduler for every KV-cache strategy, split as in vLLM v1 (a scheduler that decides, a KV
cache manager that allocates, a runner that executes), one module per idea, in reading order:

* `request`: `Request` (sizes, arrival, progress), made by `kvlab.workload.from_sizes`.
* `reservation`: reserve at admission (`KVManager`): stage 2's slabs, stage 4's fragmentation
  measurement. The paged managers (`kvlab.paged`, `kvlab.prefix`) are called directly.
* `scheduler`: `Scheduler` (continuous batching: admit, run, preempt under step budgets).
* `cost_model`: simulation's roofline step time on named cards (derated: `kvlab.calibration`).
* `model_runner`: `ModelRunner` (model mode: one forward pass a step, real cache, sampling).
* `engine_core`: `engine_step`, `serve` (a trace arriving over time), `SimulatedExecutor`.
* `strategies`: the one strategy factory (`STRATEGIES`, `simulated_manager`, `model_strategy`).
* `metrics`: concurrency, KV usage, preemptions, TTFT/TPOT percentiles, tokens/s, plots.
* `llm_engine`: `LLMEngine` and `generate_batch`: the same scheduler for prompts given up front
  (n > 1 with copy-on-write, sampling, prefix caching), what stages 4-6 run.

Elsewhere: traces (`kvlab.traces.load_trace`), `kvlab report --measure` (`kvlab.report_capacity`),
the clock's fit (`kvlab.calibration`), the naive server's OOM on a GPU (`kvlab.tools.oom_story`).
"""

from ..gpus import CARDS, Card, get_card
from ..lazy_import import on_first_use
from ..sampling import SamplingParams
from ..workload import from_sizes, poisson_arrivals, shrink, speed_up, synthetic_prompt_ids
from .cost_model import CostModel
from .engine_core import SimulatedExecutor, StepResult, engine_step, serve
from .metrics import ROW_KEYS, ServeResult, StepSeries, format_rows, percentile, plot_memory
from .reservation import (ContiguousManager, ExactBlocksManager, FirstFitSlabManager, GapRefusal,
                          KVManager)
from .request import Request, RequestState
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .strategies import STRATEGIES, model_strategy, simulated_manager

# Model mode's modules load when first used: simulation runs without torch.
__getattr__, __dir__ = on_first_use(__name__, {
    "llm_engine": ("BatchResult", "EngineStats", "LLMEngine", "default_pool_size",
                   "generate_batch"),
    "model_runner": ("ModelRunner",),
})

__all__ = [
    "Request", "RequestState", "SamplingParams", "from_sizes", "poisson_arrivals", "speed_up",
    "shrink", "synthetic_prompt_ids", "KVManager", "ContiguousManager", "FirstFitSlabManager",
    "ExactBlocksManager", "GapRefusal", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Card",
    "CARDS", "get_card", "CostModel", "ModelRunner", "SimulatedExecutor", "StepResult",
    "engine_step", "serve", "simulated_manager", "model_strategy", "STRATEGIES", "ServeResult",
    "StepSeries", "ROW_KEYS", "format_rows", "percentile", "plot_memory", "LLMEngine",
    "EngineStats", "BatchResult", "generate_batch", "default_pool_size",
]
