"""`kvlab size`: KV-cache and weight sizes of a model, and what fits on a card (stage 0)."""

from __future__ import annotations

import argparse
import json

from ..config import load_config
from ..sizing import (GPU_MEMORY_GIB, MAX_BATCH, MAX_SEQ_LEN, SizingError, dtype_bytes,
                      format_bytes, plural, size_report)
from ..tp_fit import smallest_fitting_tp, tp_shortfall
from .arguments import DTYPES, float_up_to, int_up_to

__all__ = ["register", "run"]


def register(commands) -> None:
    """Add `kvlab size` to the argparse subparsers (imports nothing heavy)."""
    size = commands.add_parser("size", help="KV-cache and weight sizes of a model")
    size.add_argument("model", help="preset name or path to a config.json / checkpoint folder")
    size.add_argument("--batch", type=int_up_to(MAX_BATCH), default=1, help="concurrent requests")
    size.add_argument("--seq-len", type=int_up_to(MAX_SEQ_LEN), default=4096,
                      help="tokens per request")
    size.add_argument("--dtype", choices=DTYPES, default="bf16", help="the weights' dtype")
    size.add_argument("--kv-cache-dtype", choices=DTYPES, default=None,
                      help="the KV cache's dtype (as vLLM's --kv-cache-dtype); default: --dtype")
    size.add_argument("--tp", type=int_up_to(1024), default=1, help="tensor-parallel GPUs")
    gpu = size.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", help=f"one of {', '.join(GPU_MEMORY_GIB)} (nominal memory), or "
                                   f"'local' (what torch.cuda reports; the default when a GPU "
                                   f"is present)")
    gpu.add_argument("--gpu-mem", type=float_up_to(16384), metavar="GIB",
                     help="GPU memory in GiB")
    size.add_argument("--gpu-memory-utilization", type=float_up_to(1.0), default=None,
                      help="share of the GPU the server may use (vLLM's default 0.9); needs a "
                           "GPU (--gpu, --gpu-mem, or one on this machine)")
    size.add_argument("--json", action="store_true")
    size.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..sizing import local_gpu_memory

    config = load_config(args.model)
    gpu = args.gpu
    if gpu is None and args.gpu_mem is None and local_gpu_memory() is not None:
        gpu = "local"  # a GPU is present: size against what torch.cuda reports for it
    if gpu is None and args.gpu_mem is None and args.gpu_memory_utilization is not None:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization:g}: no GPU to "
                         f"take a share of (this machine has none); add --gpu or --gpu-mem")
    report = size_report(config, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                         kv_cache_dtype=args.kv_cache_dtype, tp=args.tp, gpu=gpu,
                         gpu_mem_gib=args.gpu_mem,
                         gpu_memory_utilization=args.gpu_memory_utilization or 0.9)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    per_gpu = (f" per GPU (tp={report.tp}, {plural(report.kv_heads_per_gpu, 'KV head')} each)"
               if report.tp > 1 else "")
    weights_per_gpu = f" per GPU (tp={report.tp})" if report.tp > 1 else ""
    dtypes = report.dtype if report.kv_cache_dtype == report.dtype else \
        f"weights {report.dtype}, KV cache {report.kv_cache_dtype}"
    print(f"{config.name}: {report.num_parameters:,} parameters "
          f"({count_words(report.num_parameters)}), {dtypes}")
    print(f"KV bytes per token{per_gpu}: 2 x {config.num_hidden_layers} layers x "
          f"{plural(report.kv_heads_per_gpu, 'KV head')} x {config.head_dim} head_dim x "
          f"{dtype_bytes(report.kv_cache_dtype)} B"
          f" = {exact_and_readable(report.kv_bytes_per_token)}")
    if report.kv_heads_replicated > 1:  # vLLM does the same: a KV head cannot be split
        print(f"tp={report.tp} > num_key_value_heads={config.num_key_value_heads}: each GPU "
              f"keeps one whole KV head, and each KV head is replicated on "
              f"{report.kv_heads_replicated} GPUs")
    print(f"KV cache for {plural(args.batch, 'request')} x {plural(args.seq_len, 'token')}"
          f"{per_gpu}: {exact_and_readable(report.kv_cache_bytes)}")
    if args.seq_len > config.max_position_embeddings:
        print(f"note: {args.seq_len:,} tokens is beyond the model's max_position_embeddings="
              f"{config.max_position_embeddings:,}; a server would refuse such requests")
    print(f"weights{weights_per_gpu}: {exact_and_readable(report.weights_bytes, decimal=True)}")
    if report.gpu is not None:
        print(f"on {report.gpu} ({format_bytes(report.gpu_memory_bytes)}, "
              f"{report.gpu_memory_source}): weights {report.weights_share_of_gpu:.1%}, this KV "
              f"cache {report.kv_share_of_gpu:.1%} of the card")
        print(f"requests of {plural(args.seq_len, 'token')} that fit beside the weights "
              f"(gpu_memory_utilization={report.gpu_memory_utilization}): "
              f"{report.max_concurrent_requests:,}")
        if report.max_concurrent_requests == 0:
            print(f"note: {not_one_request(config, report)}")
    return 0


def not_one_request(config, report) -> str:
    """Why not one request fits on the report's card at its tp, and the tp at which one does."""
    fit = dict(max_model_len=report.seq_len, dtype=report.dtype,
               kv_cache_dtype=report.kv_cache_dtype,
               gpu_memory_utilization=report.gpu_memory_utilization)
    why = tp_shortfall(config, report.gpu, report.gpu_memory_bytes, tp=report.tp, **fit)
    try:
        smallest = smallest_fitting_tp(config, report.gpu, report.gpu_memory_bytes, **fit)
    except SizingError as error:
        return str(error)
    return f"at tp {report.tp}, {why}; --tp {smallest} fits one"


def exact_and_readable(num_bytes: int, decimal: bool = False) -> str:
    """Exact bytes, then a readable size where it adds something: 987648 -> '987,648 B (964.5
    KiB)'; 512 -> '512 B'. `decimal` adds decimal units, as model cards quote weights:
    '(131.42 GiB, 141.1 GB)'; MB below 1 GB, so a small model never reads '0.0 GB'."""
    if num_bytes < 1024:
        return f"{num_bytes:,} B"
    readable = format_bytes(num_bytes)
    if decimal:
        scale, unit = (1e9, "GB") if num_bytes >= 1e9 else (1e6, "MB")
        readable += f", {num_bytes / scale:.1f} {unit}" if num_bytes >= 1e6 else ""
    return f"{num_bytes:,} B ({readable})"


def count_words(count: int) -> str:
    """70553706496 -> '70.55 billion'; 3541248 -> '3.54 million' (never 'B', which reads as bytes)."""
    for scale, word in ((1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if count >= scale:
            return f"{count / scale:.2f} {word}"
    return str(count)
