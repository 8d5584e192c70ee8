"""kvlab's side of the comparison: the workload through `LLMEngine`, recorded as vLLM's side is.

The driver in vLLM's venv records its scheduler through a subclass (`scheduler_cls`) whose
`schedule()` and `update_from_output()` note the queue lengths and the tokens sampled. Here the
same two points are hooked on kvlab's `Scheduler` (`schedule` and `update`), so the two engines
are read at the same moments and their figures mean the same thing (see `settings`).

`_run_engine` is the one function that calls into kvlab's serving engine. The prefix-cache
queries and hits are the engine's own counters (`LLMEngine.prefix_stats`), which count first
admissions only, as vLLM's `prefix_cache_queries` and `prefix_cache_hits` do.
"""

from __future__ import annotations

import time
from typing import Callable

from .settings import EngineSettings
from .workloads import Workload

__all__ = ["run_kvlab"]


def _run_engine(model, workload: Workload, settings: EngineSettings, on_schedule: Callable,
                on_update: Callable) -> tuple[list[list[int]], int, int, tuple[int, int]]:
    """Run the workload through kvlab's engine, calling on_schedule(scheduler, output) after each
    decision and on_update(output) after each step's tokens are recorded.

    Returns (generated ids per request, preemptions, free blocks before the first step, prefix
    cache (queries, hits) in tokens: the engine's own counters, first admissions only as vLLM's,
    (0, 0) without prefix caching).
    """
    import torch

    from kvlab.paged.budget import kv_block_bytes
    from kvlab.serving import LLMEngine

    num_blocks = settings.kvlab_blocks(kv_block_bytes(model.config, settings.block_size,
                                                      torch.float32))
    engine = LLMEngine(model, num_blocks, settings.block_size, settings.max_model_len,
                       settings.max_num_seqs, eos_token_id=None,
                       enable_prefix_caching=settings.enable_prefix_caching,
                       max_num_batched_tokens=settings.max_num_batched_tokens)
    ids = [engine.add_request(prompt, n) for prompt, n in zip(workload.prompts,
                                                               workload.max_tokens)]
    scheduler = engine.scheduler
    schedule, update = scheduler.schedule, scheduler.update

    def recorded_schedule():
        output = schedule()
        on_schedule(scheduler, output)
        return output

    def recorded_update(output, sampled, now_s):
        done = update(output, sampled, now_s)
        on_update(output)
        return done

    scheduler.schedule, scheduler.update = recorded_schedule, recorded_update
    free_blocks = engine.cache.manager.num_free_blocks
    engine.run()
    stats = engine.prefix_stats
    counts = (0, 0) if stats is None else (stats.num_query_tokens, stats.num_hit_tokens)
    return [engine.outputs(i)[0] for i in ids], scheduler.num_preemptions, free_blocks, counts


def run_kvlab(model, workload: Workload, settings: EngineSettings) -> dict:
    """The workload through kvlab; returns a result with `settings.RESULT_KEYS`."""
    import torch

    from kvlab import __version__

    torch.set_num_threads(settings.threads)
    running: list[int] = []
    waiting: list[int] = []
    batched: list[int] = []
    cached = [0] * len(workload.prompts)
    times: list[list[float]] = [[] for _ in workload.prompts]
    start: list[float] = []
    cpu_start: list[float] = []
    before: dict[int, int] = {}

    def on_schedule(scheduler, output) -> None:
        if not start:
            start.append(time.perf_counter())
            cpu_start.append(time.process_time())
        running.append(len(scheduler.running))
        waiting.append(len(scheduler.waiting))
        batched.append(output.num_batched_tokens)
        for request in output.admitted:
            if request.num_preemptions == 0:  # first admission, as vLLM reports it
                cached[request.request_id] = request.num_cached_tokens
        before.clear()
        before.update((r.request_id, r.num_output_tokens) for r, _ in output.scheduled)

    def on_update(output) -> None:
        now = time.perf_counter() - start[0]
        for request, _ in output.scheduled:
            new = request.num_output_tokens - before[request.request_id]
            times[request.request_id] += [now] * new

    outputs, preemptions, free_blocks, (queries, hits) = _run_engine(
        model, workload, settings, on_schedule, on_update)
    cpu_s = time.process_time() - cpu_start[0] if cpu_start else None
    return {"engine": "kvlab", "version": __version__, "kv_capacity_blocks": free_blocks,
            "kv_capacity_tokens": free_blocks * settings.block_size, "outputs": outputs,
            "num_cached_tokens": cached, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "num_preemptions": preemptions,
            "steps": {"running": running, "waiting": waiting, "batched_tokens": batched}, "token_times_s": times,
            "torch_threads": torch.get_num_threads(), "cpu_s": cpu_s}
