"""Stage 7 on a GPU: the naive server runs out of memory under a real burst; paged + prefix holds.

    python -m kvlab.tools.oom_story --out DIR            # a CUDA GPU (the GPU tour's step)
    python -m kvlab.tools.oom_story --out DIR --dry-run  # the same code path on the CPU

One process, one model, one workload, two strategies through the one scheduler (`serve`):

1. A model of a real shape with random weights (default Llama-3.1-8B's shape in bf16; its RoPE
   scaling is dropped, which changes no size) and a burst of real traffic: the first requests of
   the Azure LLM inference conversation trace (2023), arrivals sped up so they land within seconds.
2. Start-up as vLLM does it: the weights are loaded, one profiling forward pass of the largest step
   (max_num_batched_tokens prompt tokens at the end of a max_model_len sequence) measures the
   activation peak with `torch.cuda.max_memory_allocated`.
3. The memory is limited on purpose, the way vLLM limits itself: gpu_memory_utilization is the share
   of the card the server may use, enforced for both runs with
   `torch.cuda.set_per_process_memory_fraction(gpu_memory_utilization)`. It is chosen here so that
   what it allows = what the process holds now (the weights) + the activation peak + `--kv-gib`
   for KV. At vLLM's 0.9 of a 139 GiB card about 110 GiB would be left for KV, and the whole
   default burst (200 requests, 227,745 tokens of prompt + max output = 27.8 GiB at 128 KiB per
   token, were they all held at once) would fit: no error to see. At this share it runs out during
   the burst. (Deliberately lowered, and every report says so.)
4. naive (`.naive`): one tensor per request; the allocator refuses; the error is
   caught and reported with the allocator's figures (`.allocator`); the server goes on.
5. paged + prefix: the block pool is sized as vLLM sizes it, gpu_memory_utilization x the card -
   weights - activation peak (= `--kv-gib`) (`kvlab.paged.budget.num_blocks_for_budget`),
   allocated once; the same burst is served by preempting instead of failing. Reported: peak
   running, preemptions, `torch.cuda.max_memory_allocated`, every block free at the end.

Each run has a time budget; a run stopped by it is reported as stopped, with what it had done.
The dry run uses the course's tiny model on the CPU with lengths / 16, and a `ByteLimit` in place of
the GPU's allocator (no fragmentation there: its figures say "emulated"). The results go to
<out>/<name>.json and <name>.md (name: `--name`, default oom_story), written after each run so a
stopped stage keeps what it did.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import torch

from kvlab.config import load_config
from kvlab.model import LlamaForCausalLM
from kvlab.paged.budget import kv_block_bytes, num_blocks_for_budget
from kvlab.paged.paged_cache import PagedKVCache
from kvlab import serving as req
from kvlab.serving.engine_core import serve
from kvlab.serving.strategies import paged_manager
from kvlab.serving.model_runner import ModelRunner
from kvlab.serving.scheduler import SchedulerConfig
from kvlab.traces import load_trace
from kvlab.sizing import format_bytes, kv_bytes_per_token
from .allocator import ByteLimit, run_peaks
from .naive import NaiveExecutor, NaiveManager, naive_store
from .report import describe_run, write_record

__all__ = ["StoryConfig", "run_story", "random_model", "main"]


@dataclasses.dataclass
class StoryConfig:
    """Everything one run of the story depends on (defaults: the GPU run)."""

    model: str = "llama-3.1-8b"
    num_layers: int | None = None   # fewer decoder layers than the preset (None: all)
    trace: str = "azure-conv"
    num_requests: int = 200
    speedup: float = 20.0
    shrink: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_gib: float = 8.0             # KV memory under the limit (sets gpu_memory_utilization)
    attention: str = "triton"       # the paged run's backend on a GPU (the CPU uses torch)
    budget_s: float = 30.0          # wall-clock seconds per strategy
    strategies: tuple[str, ...] = ("naive", "paged+prefix")
    dry_run: bool = False
    seed: int = 0

    @classmethod
    def dry(cls, **changes) -> "StoryConfig":
        """The CPU dry run: tiny model, lengths / 16, a small emulated limit, short budgets."""
        return cls(**{**dict(model="tiny", num_requests=60, speedup=200.0, shrink=16,
                             max_model_len=512, max_num_seqs=64, max_num_batched_tokens=256,
                             kv_gib=0.0015, attention="torch", budget_s=15.0, dry_run=True),
                      **changes})


class OutOfTime(Exception):
    """A run used up its time budget (raised between steps)."""


class TimedExecutor:
    """Wraps an executor: stops the run once its time is up, and keeps the figures a stopped run
    still has (peak running, steps, requests seen)."""

    def __init__(self, inner, budget_s: float, num_running):
        self.inner, self.num_running = inner, num_running
        self.deadline = time.perf_counter() + budget_s
        self.steps = self.peak_running = 0
        self.seen: dict[int, req.Request] = {}

    def execute(self, output):
        if time.perf_counter() > self.deadline:
            raise OutOfTime
        self.peak_running = max(self.peak_running, self.num_running())
        for request, _ in output.scheduled:
            self.seen[request.request_id] = request
        self.steps += 1
        return self.inner.execute(output)

    def release(self, request) -> None:
        self.inner.release(request)

    def __getattr__(self, name):  # anything else the loop asks of an executor: the inner one's
        return getattr(self.inner, name)


def random_model(name: str, dtype: torch.dtype, device: torch.device,
                 num_layers: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A decoder of a preset's shape with random weights, built directly on `device` in `dtype`.

    RoPE scaling (Llama 3.1's 'llama3') is dropped: kvlab's decoder implements plain RoPE, and the
    scaling changes no tensor size. `num_layers` keeps only the first layers (a smaller run).
    """
    config = load_config(name)
    changes = {"rope_scaling": None, "name": f"{config.name} (random weights)"}
    if num_layers is not None:
        changes.update(num_hidden_layers=num_layers,
                       name=f"{config.name}, {num_layers} layers (random weights)")
    config = config.with_changes(**changes)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def workload(story: StoryConfig, vocab_size: int) -> tuple[list[req.Request], str]:
    """The burst: the trace's first requests, lengths / shrink, arrivals / speedup, prompt ids."""
    requests = req.from_sizes(load_trace(story.trace, story.num_requests))
    if story.shrink > 1:
        requests = req.shrink(requests, story.shrink)
    requests = req.speed_up(requests, story.speedup)
    for request in requests:
        request.prompt_token_ids = req.synthetic_prompt_ids(request, vocab_size, story.seed)
    span = requests[-1].arrival_s - requests[0].arrival_s
    text = (f"{story.trace}: first {len(requests)} requests"
            + (f", lengths / {story.shrink}" if story.shrink > 1 else "")
            + f", arrivals {story.speedup:g}x faster (all within {span:.1f} s), "
              f"{sum(r.total_len for r in requests):,} tokens of prompt + max output in all")
    return requests, text


@torch.no_grad()
def profile_workspace(model, story: StoryConfig) -> int:
    """Peak activation bytes of the largest step: max_num_batched_tokens prompt tokens at the end
    of a max_model_len sequence (CUDA's max_memory_allocated over the pass, minus what was there
    before). 0 on the CPU, where no allocator keeps such books."""
    device = model.device
    if device.type != "cuda":
        return 0
    config, tokens = model.config, min(story.max_num_batched_tokens, story.max_model_len)
    kv = torch.zeros((config.num_hidden_layers, 2, story.max_model_len,
                      config.num_key_value_heads, config.head_dim), dtype=model.dtype,
                     device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start = story.max_model_len - tokens
    ids = torch.randint(config.vocab_size, (tokens,), device=device)
    positions = torch.arange(start, story.max_model_len, device=device)
    model(ids, positions, naive_store([kv], [tokens], [story.max_model_len]))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv
    torch.cuda.empty_cache()
    return int(peak)


def _run(name, kv, executor, requests, story, num_running, bytes_per_token) -> dict:
    """One strategy through `serve` under the time budget; its figures as a dict."""
    device = getattr(executor, "model").device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)  # num_ooms, num_alloc_retries per run
    timed = TimedExecutor(executor, story.budget_s, num_running)
    started = time.perf_counter()
    config = SchedulerConfig(story.max_num_seqs, story.max_num_batched_tokens)
    try:
        result = serve(requests, kv, timed, config, bytes_per_token, progress=False)
        out = {"status": "completed", **result.row()}
    except (OutOfTime, torch.OutOfMemoryError) as error:
        # Stopped by the clock, or an allocation outside the KV manager failed (a forward pass):
        # either way, the figures so far.
        status = (f"stopped by its {story.budget_s:g} s time budget" if isinstance(error, OutOfTime)
                  else f"failed: torch.OutOfMemoryError ({str(error).splitlines()[0][:200]})")
        seen = timed.seen.values()
        out = {"status": status, "strategy": kv.name, "requests": len(requests),
               "finished": sum(r.state is req.RequestState.FINISHED for r in seen),
               "peak_running": timed.peak_running}
    out.update(strategy=name, wall_s=time.perf_counter() - started, num_steps=timed.steps)
    if device.type == "cuda":
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["allocator_peaks"] = run_peaks(device)
    return out


def run_story(story: StoryConfig, out: Path | None = None, log=print,
              name: str = "oom_story") -> dict:
    """Build, limit, run naive then paged + prefix; returns the story as a dict (JSON-ready) and
    writes <out>/<name>.{json,md} after each run when `out` is given.

    Raises:
        RuntimeError: not a dry run and no CUDA device.
    """
    if not story.dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU here; use --dry-run")
    device = torch.device("cpu" if story.dry_run else "cuda")
    try:
        return _story(story, out, log, device, name)
    finally:  # lift the limit: whatever runs next in this process gets the whole card again
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            torch.cuda.empty_cache()


def _story(story: StoryConfig, out: Path | None, log, device: torch.device, name: str) -> dict:
    dtype = torch.float32 if story.dry_run else torch.bfloat16
    started = time.perf_counter()
    model = random_model(story.model, dtype, device, story.num_layers, story.seed)
    config = model.config
    requests, described = workload(story, config.vocab_size)
    bytes_per_token = kv_bytes_per_token(config, dtype)
    workspace = profile_workspace(model, story)
    kv_room = int(story.kv_gib * 2**30)
    record = {"name": name, "story": dataclasses.asdict(story), "model": config.name,
              "dtype": str(dtype),
              "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "default",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "weights_bytes": model.weights_bytes, "kv_bytes_per_token": bytes_per_token,
              "workspace_bytes": workspace, "workload": described, "runs": []}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        in_use = torch.cuda.memory_reserved(device)   # the weights, as the allocator holds them
        total = torch.cuda.mem_get_info(device)[1]
        utilization = (in_use + workspace + kv_room) / total
        if utilization >= 1:
            raise ValueError(f"weights {format_bytes(in_use)} + activations "
                             f"{format_bytes(workspace)} + KV {format_bytes(kv_room)} > the "
                             f"card's {format_bytes(total)}; lower --kv-gib")
        torch.cuda.set_per_process_memory_fraction(utilization, device)
        allocator = None
        limit_note = (f"gpu_memory_utilization {utilization:.4f} of {format_bytes(total)}, "
                      f"enforced by torch.cuda.set_per_process_memory_fraction")
    else:
        in_use, total, utilization = model.weights_bytes, model.weights_bytes + kv_room, 1.0
        allocator = ByteLimit(total, in_use)
        limit_note = "an emulated device of that size on the CPU (ByteLimit)"
    limit = int(utilization * total)
    record.update(limit_bytes=limit, in_use_bytes=in_use, kv_room_bytes=kv_room,
                  gpu_memory_utilization=utilization, total_bytes=total,
                  limit_note=limit_note, setup_s=time.perf_counter() - started)
    log(f"{config.name}, {dtype}, on {record['device']}: weights {format_bytes(in_use)}, "
        f"activation peak {format_bytes(workspace)}, KV {format_bytes(bytes_per_token)}/token\n"
        f"memory limit {format_bytes(limit)} = weights + activations + {format_bytes(kv_room)} "
        f"for KV: {limit_note}\nworkload {described}")

    memory = dict(limit=limit, in_use=in_use, workspace=workspace, allocator=allocator,
                  bytes_per_token=bytes_per_token, pool_rule=(
                      f"gpu_memory_utilization {utilization:.4f} x {format_bytes(total)} - "
                      f"weights {format_bytes(in_use)} - activations {format_bytes(workspace)}"))
    for strategy in story.strategies:
        run = STRATEGY_RUNS[strategy](model, requests, story, **memory)
        record["runs"].append(run)
        log(describe_run(run))
        write_record(record, out)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record["seconds"] = time.perf_counter() - started
    write_record(record, out)
    return record


def naive_run(model, requests, story, limit, in_use, workspace, allocator, bytes_per_token,
              pool_rule) -> dict:
    """The naive server: KV memory = whatever the allocator gives under the limit."""
    device = model.device
    naive = NaiveManager(model.config, model.dtype, device, story.max_model_len,
                         limit - in_use - workspace, workspace, allocator=allocator,
                         limit_bytes=limit if allocator is None else None)
    run = _run("naive", naive, NaiveExecutor(model, naive), requests, story,
               lambda: len(naive.kv), bytes_per_token)
    run.update(out_of_memory_errors=len(naive.reports), concurrency_cap=naive.max_running,
               reports=[report.as_dict() for report in naive.reports],
               allocator_at_end=naive.figures().as_dict())
    naive.release_all()
    return run


def paged_prefix_run(model, requests, story, limit, in_use, workspace, allocator,
                     bytes_per_token, pool_rule) -> dict:
    """Paged + prefix: one pool of vLLM's size, allocated once at start-up."""
    config, dtype, device = model.config, model.dtype, model.device
    block_bytes = kv_block_bytes(config, story.block_size, dtype)
    num_blocks = num_blocks_for_budget(limit, in_use, block_bytes, workspace)
    prefix = paged_manager(num_blocks, story.block_size, story.max_model_len,
                           enable_prefix_caching=True)
    cache = PagedKVCache(config, num_blocks, story.block_size, dtype=dtype, device=device,
                         attention_backend="torch" if story.dry_run else story.attention,
                         manager=prefix)
    run = _run("paged+prefix", prefix, ModelRunner(model, cache), requests, story,
               lambda: len(cache.manager.tables), bytes_per_token)
    run.update(num_blocks=num_blocks, pool_bytes=num_blocks * block_bytes, pool_rule=pool_rule,
               blocks_in_use_at_end=cache.manager.num_used_blocks)
    return run


STRATEGY_RUNS = {"naive": naive_run, "paged+prefix": paged_prefix_run}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <name>.{json,md}")
    parser.add_argument("--name", default="oom_story", help="file names (and the headline)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, emulated limit")
    parser.add_argument("--model", default=None, help="preset whose shape to use")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--speedup", type=float, default=None)
    parser.add_argument("--kv-gib", type=float, default=None, help="KV room under the limit")
    parser.add_argument("--attention", choices=("torch", "triton"), default=None)
    parser.add_argument("--budget", type=float, default=None, help="seconds per strategy")
    parser.add_argument("--strategies", nargs="+", choices=tuple(STRATEGY_RUNS), default=None)
    parser.add_argument("--expandable-segments", action="store_true",
                        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA "
                             "starts): the allocator's answer to fragmentation")
    args = parser.parse_args(argv)
    if args.expandable_segments:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    changes = {key: value for key, value in
               [("model", args.model), ("num_layers", args.num_layers),
                ("num_requests", args.num_requests), ("speedup", args.speedup),
                ("kv_gib", args.kv_gib), ("attention", args.attention),
                ("budget_s", args.budget),
                ("strategies", tuple(args.strategies) if args.strategies else None)]
               if value is not None}
    story = StoryConfig.dry(**changes) if args.dry_run else StoryConfig(**changes)
    if args.dry_run:
        torch.set_num_threads(1)  # the tiny model: one thread is fastest (see kvlab generate)
    try:
        run_story(story, args.out, name=args.name)
    except RuntimeError as error:
        if "no CUDA GPU" not in str(error):
            raise
        print(f"oom story: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / (args.name + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
