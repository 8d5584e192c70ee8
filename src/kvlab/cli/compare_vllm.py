"""`kvlab compare-vllm`: one workload through kvlab and through vLLM itself, side by side.

    kvlab compare-vllm --workload chats --vllm-python vllm-venv/bin/python --plot running.png
    kvlab compare-vllm --workload mooncake --num-blocks 80 --no-prefix-caching --json out.json

Flags carry vLLM's engine-argument names. vLLM runs in its own venv (--vllm-python, or
$KVLAB_VLLM_PYTHON); without it, or when it fails, kvlab's own figures are still printed, then
one line naming the problem and the fix, exit status 2. See `kvlab.vllm_compare`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .arguments import positive_int

__all__ = ["register", "run_compare_vllm"]


def register(commands) -> None:
    """Add `kvlab compare-vllm` to the argparse subparsers (imports nothing heavy)."""
    p = commands.add_parser(
        "compare-vllm", help="run one workload through kvlab and vLLM, side by side",
        description="The same batch (greedy, fixed output lengths, fp32) through vLLM's CPU "
                    "build and kvlab's engine with the same settings: tokens, prefix-cache "
                    "hits, preemptions, running/waiting per step, tokens/s, TTFT, TPOT.")
    p.add_argument("--workload", choices=("chats", "mooncake"), default="chats",
                   help="chats: 16 chats sharing a system prompt (the model's chat template); "
                        "mooncake: a shrunk burst of the Mooncake conversation trace")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (after `kvlab fetch smollm2-135m`, default) or tiny")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="requests in the workload (default 16 chats, 24 Mooncake requests)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="output tokens per request (default 48 for chats; Mooncake: the "
                        "trace's, shrunk, at most 32)")
    p.add_argument("--block-size", type=positive_int, default=32,
                   help="tokens per block; vLLM's CPU attention takes multiples of 32")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=positive_int, default=None,
                      help="blocks in the pool (vLLM's num_gpu_blocks_override; vLLM keeps block "
                           "0 as its null block; default 40)")
    pool.add_argument("--kv-cache-memory-bytes", type=positive_int, default=None,
                      help="size the pool from bytes instead (vLLM's kv_cache_memory_bytes; "
                           "kvlab divides by its own block bytes)")
    p.add_argument("--kvlab-num-blocks", type=positive_int, default=None,
                   help="kvlab's pool (default: vLLM's usable pool, num-blocks - 1, since vLLM "
                        "keeps block 0 as its null block; give --num-blocks to see the difference)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--max-model-len", type=positive_int, default=1024)
    p.add_argument("--prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's enable_prefix_caching (default on)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads for each engine (torch and OpenMP)")
    p.add_argument("--vllm-python", default=os.environ.get("KVLAB_VLLM_PYTHON"),
                   help="python of vLLM's own venv (default $KVLAB_VLLM_PYTHON)")
    p.add_argument("--vllm-log", default=None, help="write vLLM's log to this file")
    p.add_argument("--transformers", action="store_true",
                   help="also time transformers' own generate on the same batch (static, padded)")
    p.add_argument("--plot", default=None, help="save running/waiting per step to this image")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write both results and the table as JSON to FILE")
    p.set_defaults(func=run_compare_vllm)


def run_compare_vllm(args: argparse.Namespace) -> int:
    from ..vllm_compare import EngineSettings, format_table, plot_steps, run_comparison

    num_blocks = args.num_blocks or (None if args.kv_cache_memory_bytes else 40)
    settings = EngineSettings(args.block_size, num_blocks, args.max_num_seqs,
                              args.max_num_batched_tokens, args.max_model_len,
                              args.enable_prefix_caching, args.kvlab_num_blocks, args.threads,
                              args.kv_cache_memory_bytes)
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
    from ..vllm_compare import timing

    t = timing(kvlab)
    return (f"kvlab only: capacity {kvlab['kv_capacity_blocks']} blocks, prefix-cache hits "
            f"{kvlab['prefix_cache_hits']:,} of {kvlab['prefix_cache_queries']:,} tokens, "
            f"{kvlab['num_preemptions']} preemptions, {len(kvlab['steps']['running'])} steps, "
            f"{t.tokens_per_s:.1f} tokens/s, TTFT p50 {1000 * t.ttft_p50_s:.0f} ms, "
            f"TPOT p50 {1000 * t.tpot_p50_s:.0f} ms")
