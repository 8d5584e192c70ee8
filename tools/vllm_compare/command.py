"""What `kvlab compare-vllm` does (its flags are declared in `kvlab.cli.compare_vllm`): run one
comparison, write its JSON, print the side-by-side table (or kvlab's figures alone and the one-line
reason vLLM did not run, exit status 2), and plot running / waiting requests per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .comparison import WORKLOAD_DEFAULTS, run_comparison
from .plot import plot_steps
from .settings import EngineSettings
from .table import format_table, speed_ratio, timing

__all__ = ["engine_settings", "run_compare_vllm"]


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The command line's settings; pool, step budget and max_model_len default to the workload's
    (`WORKLOAD_DEFAULTS`: the long prompts need more of each), else to `EngineSettings`'."""
    fields = {field.name: field.default for field in dataclasses.fields(EngineSettings)}
    defaults = {name: fields[name] for name in ("num_blocks", "max_num_batched_tokens",
                                                "max_model_len")}
    defaults.update(WORKLOAD_DEFAULTS.get(args.workload, {}))
    chosen = {name: value if (value := getattr(args, name)) is not None else default
              for name, default in defaults.items()}
    if args.kv_cache_memory_bytes:
        chosen["num_blocks"] = None
    return EngineSettings(args.block_size, chosen["num_blocks"], args.max_num_seqs,
                          chosen["max_num_batched_tokens"], chosen["max_model_len"],
                          args.enable_prefix_caching, args.kvlab_num_blocks, args.threads,
                          args.kv_cache_memory_bytes)


def run_compare_vllm(args: argparse.Namespace) -> int:
    settings = engine_settings(args)
    result = run_comparison(args.model, args.workload, settings, args.vllm_python,
                            args.num_requests, args.max_tokens, args.vllm_log,
                            with_transformers=args.transformers)
    work = result.workload
    title = (f"{work.name}: {len(work.prompts)} requests, "
             f"{sum(map(len, work.prompts)):,} prompt tokens, {sum(work.max_tokens):,} output "
             f"tokens; block_size {settings.block_size}, "
             f"{_pool(settings)}"
             f", max_num_seqs {settings.max_num_seqs}, max_num_batched_tokens "
             f"{settings.max_num_batched_tokens}, max_model_len {settings.max_model_len}, "
             f"prefix caching {'on' if settings.enable_prefix_caching else 'off'}, "
             f"{settings.threads} thread(s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result.to_json(), handle)
    if result.vllm is None:
        print(title)
        print(_kvlab_alone(result.kvlab))
        if result.transformers:
            print(_baseline(result.transformers, result.kvlab, "kvlab's"))
        print(f"kvlab compare-vllm: error: {result.vllm_error}", file=sys.stderr)
        return 2
    print(format_table(result.rows, title))
    print(f"speed, kvlab / vLLM (vLLM's wall time / kvlab's): "
          f"{speed_ratio(result.kvlab, result.vllm):.2f}x")
    print(f"torch threads: kvlab {result.kvlab.get('torch_threads')}, vLLM "
          f"{result.vllm.get('torch_threads')}")
    if result.transformers:
        print(_baseline(result.transformers, result.vllm, "vLLM's"))
    if args.plot:
        print(f"plot: {plot_steps(result.kvlab, result.vllm, args.plot, title)}")
    return 0


def _baseline(baseline: dict, reference: dict, whose: str) -> str:
    """transformers' line: its speed and how many requests match the reference's tokens."""
    if "error" in baseline:
        return f"transformers generate: not run: {baseline['error']}"
    outputs = reference["outputs"]
    same = sum(a == b for a, b in zip(baseline["outputs"], outputs))
    return (f"transformers {baseline['version']} generate (one static batch, left-padded): "
            f"{baseline['tokens_per_s']:.1f} tokens/s; tokens identical to {whose} "
            f"{same}/{len(outputs)}")


def _pool(settings) -> str:
    """The pool as the title states it."""
    pool = (f"num_blocks {settings.num_blocks}" if settings.num_blocks is not None
            else f"kv_cache_memory_bytes {settings.kv_cache_memory_bytes:,}")
    kvlab = settings.kvlab_num_blocks
    return pool if kvlab is None else f"{pool} (kvlab {kvlab} blocks)"


def _kvlab_alone(kvlab: dict) -> str:
    """kvlab's figures when vLLM could not run."""
    t = timing(kvlab)
    return (f"kvlab only: capacity {kvlab['kv_capacity_blocks']} blocks, prefix-cache hits "
            f"{kvlab['prefix_cache_hits']:,} of {kvlab['prefix_cache_queries']:,} tokens, "
            f"{kvlab['num_preemptions']} preemptions, {len(kvlab['steps']['running'])} steps, "
            f"{t.tokens_per_s:.1f} tokens/s, TTFT p50 {1000 * t.ttft_p50_s:.0f} ms, "
            f"TPOT p50 {1000 * t.tpot_p50_s:.0f} ms")
