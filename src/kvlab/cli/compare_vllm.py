"""`kvlab compare-vllm`: one workload through kvlab and through vLLM itself, side by side.

    kvlab compare-vllm --workload chats --vllm-python vllm-venv/bin/python --plot running.png
    kvlab compare-vllm --workload mooncake --num-blocks 80 --no-prefix-caching --json out.json
    kvlab compare-vllm --workload long-shared --json long-shared.json

Flags carry vLLM's engine-argument names. vLLM runs in its own venv (--vllm-python, or
$KVLAB_VLLM_PYTHON); without it, or when it fails, kvlab's figures still print, then one line
naming the problem and the fix (exit 2). `kvlab.tools.vllm_compare` is imported only at run time.
"""

from __future__ import annotations

import argparse
import os

from .arguments import positive_int

__all__ = ["register", "run_compare_vllm"]


def register(commands) -> None:
    """Add `kvlab compare-vllm` to the argparse subparsers (imports nothing heavy)."""
    p = commands.add_parser(
        "compare-vllm", help="run one workload through kvlab and vLLM, side by side",
        description="The same batch (greedy, fixed output lengths, fp32) through vLLM's CPU "
                    "build and kvlab's engine with the same settings: tokens, prefix-cache "
                    "hits, preemptions, running/waiting per step, tokens/s, TTFT, TPOT.")
    p.add_argument("--workload", choices=("chats", "mooncake", "long", "long-shared"),
                   default="chats",
                   help="chats: 16 chats sharing a system prompt (the model's chat template); "
                        "mooncake: a shrunk burst of the Mooncake conversation trace; long: 6 "
                        "unrelated prompts of 900-4,000 tokens; long-shared: 8 questions after "
                        "one shared 3,000-token document (both: 640 blocks, max_model_len "
                        "4,128, 256 tokens a step unless given)")
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
                           "0 as its null block; default 40, 640 for the long workloads)")
    pool.add_argument("--kv-cache-memory-bytes", type=positive_int, default=None,
                      help="size the pool from bytes instead (vLLM's kv_cache_memory_bytes; "
                           "kvlab divides by its own block bytes)")
    p.add_argument("--kvlab-num-blocks", type=positive_int, default=None,
                   help="kvlab's pool (default: vLLM's usable pool, num-blocks - 1, since vLLM "
                        "keeps block 0 as its null block; give --num-blocks to see the difference)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="tokens computed a step at most (default 2,048; 256 for the long "
                        "workloads: chunked prefill)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="default 1,024; 4,128 for the long workloads")
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
    """`kvlab.tools.vllm_compare.command.run_compare_vllm`, imported now, not at start-up."""
    from kvlab.tools.vllm_compare.command import run_compare_vllm as run

    return run(args)
