"""Run one comparison workload through vLLM; print one JSON result (`settings.RESULT_KEYS`).

    /path/to/vllm-venv/bin/python vllm_driver.py SPEC.json

This file runs in vLLM's own venv, as a script: it imports vLLM and the standard library, never
kvlab (kvlab's venv does not need vLLM, and vLLM pins its own torch and transformers). SPEC.json
holds the exported model folder, the workload (token ids, max_tokens) and `EngineSettings`.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a subclass of vLLM
v1's `Scheduler` (`recording_scheduler`), passed as the `scheduler_cls` engine argument, sees
every step: after `schedule()` it records its request counts (`get_request_counts()`, what its
stat loggers read), after `update_from_output()` the time of each token sampled. vLLM's log goes
to stderr; stdout carries the JSON alone. Importing this module imports neither vLLM nor torch
(notebook 07c prints `recording_scheduler`'s source from kvlab's venv).
"""

import json
import os
import sys
import time

OVERRIDE_POOL_BYTES = 256 * 2**20  # see `run`: a placeholder the block-count override replaces


class Record:
    """What the subclass records, per engine step and per request."""

    def __init__(self) -> None:
        self.running, self.waiting, self.batched = [], [], []  # per step, after schedule()
        self.token_times = {}  # vLLM request id -> when each of its tokens was sampled (s)
        self.capacity = self.threads = self.start = self.cpu_start = None


def recording_scheduler(scheduler_cls, record, get_num_threads):
    """A subclass of vLLM v1's `Scheduler` that decides exactly as it does and writes each step
    into `record` (a `Record`); vLLM runs it when passed as `scheduler_cls`."""

    class RecordingScheduler(scheduler_cls):
        def schedule(self, *args, **kwargs):
            if record.start is None:  # the first step: the pool as it starts, then the clocks
                record.capacity = self.kv_cache_manager.block_pool.get_num_free_blocks()
                record.threads = get_num_threads()  # vLLM's CPU worker may bind its own
                record.start, record.cpu_start = time.perf_counter(), time.process_time()
            output = super().schedule(*args, **kwargs)
            running, waiting = self.get_request_counts()  # what vLLM's stat loggers read
            record.running.append(running)
            record.waiting.append(waiting)
            record.batched.append(output.total_num_scheduled_tokens)
            return output

        def update_from_output(self, *args, **kwargs):
            outputs = super().update_from_output(*args, **kwargs)
            now = time.perf_counter() - record.start
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    record.token_times.setdefault(out.request_id, []).extend(
                        [now] * len(out.new_token_ids))
            return outputs

    return RecordingScheduler


def run(spec: dict) -> dict:
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as error:  # the wrong python: kvlab's, or a venv without vLLM
        return {"error": f"{sys.executable} cannot import vLLM ({error}): run this driver with "
                         f"the python of vLLM's own venv"}

    import torch

    settings, workload = spec["settings"], spec["workload"]
    record = Record()
    if settings.get("kv_cache_memory_bytes"):  # vLLM sizes the pool from the bytes
        pool = {"kv_cache_memory_bytes": settings["kv_cache_memory_bytes"]}
    else:
        # The pool is num_gpu_blocks_override blocks whatever the bytes (vLLM clamps to it in
        # get_kv_cache_configs). The bytes are given only so that vLLM's CPU worker skips its
        # gpu_memory_utilization arithmetic, which fails when the node's share it computes is
        # below the process's own RSS ("requested memory for kv (-0.02/1.32 GiB)").
        pool = {"num_gpu_blocks_override": settings["num_blocks"],
                "kv_cache_memory_bytes": OVERRIDE_POOL_BYTES}
    llm = LLM(model=spec["model_dir"], dtype="float32", enforce_eager=True, **pool,
              skip_tokenizer_init=True, disable_log_stats=False, seed=0,
              block_size=settings["block_size"],
              max_num_seqs=settings["max_num_seqs"],
              max_num_batched_tokens=settings["max_num_batched_tokens"],
              max_model_len=settings["max_model_len"],
              enable_prefix_caching=settings["enable_prefix_caching"],
              scheduler_cls=recording_scheduler(Scheduler, record, torch.get_num_threads))
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload["max_tokens"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cpu_s = None if record.cpu_start is None else time.process_time() - record.cpu_start
    metrics = {m.name: m for m in llm.get_metrics()}

    def counter(name):
        metric = metrics.get(name)
        return None if metric is None else int(getattr(metric, "value", 0))

    # Engine request ids may carry a suffix; each output names its own.
    token_times = []
    for out in outputs:
        match = [key for key in record.token_times
                 if key == out.request_id or key.startswith(out.request_id + "-")]
        token_times.append(record.token_times[match[0]] if match else [])
    capacity = record.capacity or 0
    return {"engine": "vllm", "version": vllm.__version__,
            "kv_capacity_blocks": capacity,
            "kv_capacity_tokens": capacity * settings["block_size"],
            "outputs": [list(out.outputs[0].token_ids) for out in outputs],
            "num_cached_tokens": [int(out.num_cached_tokens or 0) for out in outputs],
            "prefix_cache_queries": counter("vllm:prefix_cache_queries") or 0,
            "prefix_cache_hits": counter("vllm:prefix_cache_hits") or 0,
            "num_preemptions": counter("vllm:num_preemptions") or 0,
            "steps": {"running": record.running, "waiting": record.waiting,
                      "batched_tokens": record.batched}, "token_times_s": token_times,
            "torch_threads": record.threads, "cpu_s": cpu_s}


def main() -> int:
    if len(sys.argv) != 2:
        print(json.dumps({"error": "usage: vllm_driver.py SPEC.json"}))
        return 2
    with open(sys.argv[1], encoding="utf-8") as handle:
        spec = json.load(handle)
    threads = str(spec["settings"].get("threads", 1))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM's log and prints go to stderr
    try:
        import torch

        torch.set_num_threads(int(threads))
        result, status = run(spec), 0
    except Exception as error:  # reported as one line in the JSON; the caller exits 2
        result, status = {"error": f"vLLM failed: {type(error).__name__}: {error}"}, 1
    sys.stdout.flush()
    os.dup2(stdout, 1)
    print(json.dumps(result), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
