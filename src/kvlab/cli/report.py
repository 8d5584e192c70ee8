"""`kvlab report`: replay real (or synthetic) traffic through every cache strategy (the main job).

    kvlab report --model llama-3.1-8b --gpu H100-80GB
    kvlab report --model llama-3.1-70b --tp 4      # bytes and the budget per GPU
"""

from __future__ import annotations

import argparse
import json

from ..config import load_config
from ..sizing import GPU_MEMORY_GIB, MAX_SEQ_LEN, format_bytes
from .arguments import (DTYPES, check_lengths, float_up_to, int_up_to, refuse_together,
                        resolve_tp)

__all__ = ["register", "run"]


def register(commands) -> None:
    """Add `kvlab report` to the argparse subparsers (imports nothing heavy)."""
    rep = commands.add_parser("report", help="replay traffic through every cache strategy")
    rep.add_argument("--model", default="llama-3.1-8b", help="preset or config.json (KV shape)")
    rep.add_argument("--dtype", choices=DTYPES, default="bf16", help="the weights' dtype")
    rep.add_argument("--kv-cache-dtype", choices=DTYPES, default=None,
                     help="the KV cache's dtype (as vLLM's --kv-cache-dtype); default: --dtype")
    workload = rep.add_mutually_exclusive_group()
    workload.add_argument("--trace", default="azure-conv",
                          help="azure-conv (default: the shipped Azure LLM conversation trace "
                               "2023), azure-code, mooncake-conversation / mooncake-synthetic "
                               "(prefix hashes: adds a paged+prefix row), or a trace file: .csv "
                               "(TIMESTAMP,ContextTokens,GeneratedTokens) or .jsonl (Mooncake)")
    workload.add_argument("--synthetic", action="store_true",
                          help="draw from the log-normal fit to the conversation trace instead "
                               "(matches mean and median; its tail is far thinner)")
    rep.add_argument("--max-model-len", type=int_up_to(MAX_SEQ_LEN), default=4096,
                     help="longest request; longer ones are rejected (default 4096; at most the "
                          "model's max_position_embeddings)")
    rep.add_argument("--tp", type=int_up_to(1024), default=None,
                     help="tensor-parallel GPUs; bytes and the budget are per GPU (default: the "
                          "smallest number at which each --gpu holds its share of the weights "
                          "and one max_model_len request's KV; 1 with --kv-budget)")
    rep.add_argument("--num-requests", type=int_up_to(1_000_000), default=None,
                     help="requests to draw (synthetic, default 10000) or read (trace, default all)")
    budget = rep.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget", type=float_up_to(16384), metavar="GIB", default=None,
                        help="KV memory in GiB (default: gpu_memory_utilization x --gpu minus "
                             "the weights)")
    budget.add_argument("--gpu", default=None,
                        help=f"the card whose memory sets the budget: one of "
                             f"{', '.join(GPU_MEMORY_GIB)} (nominal memory), or 'local' (what "
                             f"torch.cuda reports); default H100-80GB")
    rep.add_argument("--gpu-memory-utilization", type=float_up_to(1.0), default=None,
                     help="share of the GPU the server may use (vLLM's default 0.9; not with "
                          "--kv-budget)")
    rep.add_argument("--block-size", type=int_up_to(MAX_SEQ_LEN), default=16,
                     help="tokens per block of the paged strategy (vLLM's default 16)")
    rep.add_argument("--seed", type=int, default=None,
                     help="seed of the --synthetic draws (default 0)")
    rep.add_argument("--measure", action="store_true",
                     help="also serve the workload through stage 7's scheduler (every request "
                          "queued at once) and print the requests each budget really holds")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report import ContiguousStrategy, PagedStrategy, format_report, measure_held, replay
    from ..sizing import default_kv_budget, gpu_memory, kv_bytes_per_token
    from ..traces import AZURE_TRACES, MOONCAKE_TRACES, azure_trace, load_trace
    from ..workload import synthetic_requests

    refuse_together(args, "--kv-budget", "--gpu-memory-utilization",
                    "--gpu-memory-utilization only sets the default KV budget, which --kv-budget "
                    "replaces")
    if args.seed is not None and not args.synthetic:
        raise ValueError(f"--seed {args.seed}: a trace is replayed as recorded; the seed draws "
                         f"only --synthetic requests")
    config = load_config(args.model)
    check_lengths(config, args.max_model_len, args.block_size)
    kv_dtype = args.kv_cache_dtype or args.dtype
    tp_chosen = None
    if args.kv_budget is not None:
        tp = args.tp or 1
        budget, source = int(args.kv_budget * 2**30), "--kv-budget"
    else:  # vLLM's default: gpu_memory_utilization x the card, minus the weights
        card = gpu_memory(args.gpu or "H100-80GB")
        utilization = args.gpu_memory_utilization or 0.9
        tp, tp_chosen = resolve_tp(args.tp, config, card.name, card.total_bytes,
                                   max_model_len=args.max_model_len, dtype=args.dtype,
                                   kv_cache_dtype=kv_dtype, gpu_memory_utilization=utilization)
        budget = default_kv_budget(config, dtype=args.dtype, gpu_memory_bytes=card.total_bytes,
                                   gpu_memory_utilization=utilization, tp=tp)
        source = (f"{utilization} x {format_bytes(card.total_bytes)} "
                  f"({card.name}, {card.source}) - {args.dtype} weights"
                  + (" per GPU" if tp > 1 else ""))
    per_token = kv_bytes_per_token(config, kv_dtype, tp)
    prefix_hits = None
    if args.synthetic:
        requests = synthetic_requests(args.num_requests or 10_000, seed=args.seed or 0)
        workload = "synthetic log-normal fit to the Azure conversation trace (thinner tail)"
    elif args.trace in (f"mooncake-{name}" for name in MOONCAKE_TRACES):  # adds paged+prefix
        from ..prefix import report_row as prefix_row

        requests, workload, prefix_hits = prefix_row.mooncake_report_workload(
            args.trace, budget, per_token, args.max_model_len, limit=args.num_requests)
    elif args.trace in (f"azure-{service}" for service in AZURE_TRACES):
        service = args.trace.removeprefix("azure-")
        requests = azure_trace(service, limit=args.num_requests)
        workload = f"Azure LLM inference trace 2023, {service} (shipped)"
    else:
        requests = load_trace(args.trace, limit=args.num_requests)
        workload = f"trace {args.trace}"
    strategies = []
    if config.num_key_value_heads < config.num_attention_heads:
        # The same model had it kept one KV head per query head (MHA): what GQA saves.
        mha = config.with_changes(num_key_value_heads=config.num_attention_heads)
        strategies.append(ContiguousStrategy(args.max_model_len,
                                             kv_bytes_per_token(mha, kv_dtype, tp),
                                             name="contiguous-mha"))
    strategies += [ContiguousStrategy(args.max_model_len, per_token),
                   PagedStrategy(args.block_size, per_token)]
    if prefix_hits is not None:
        strategies.append(prefix_row.PrefixPagedStrategy(args.block_size, per_token))
    dtypes = args.dtype if kv_dtype == args.dtype else f"weights {args.dtype}, KV cache {kv_dtype}"
    report = replay(requests, strategies, args.max_model_len, budget, workload=workload,
                    model=f"{config.name} ({dtypes})", kv_budget_source=source, tp=tp,
                    tp_chosen_because=tp_chosen)
    if args.measure:
        measure_held(report, requests, args.block_size)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        estimated = any(not row.requests_held_exact for row in report.rows)
        print("\n".join([format_report(report)]
                        + (["kvlab report --measure serves the workload through stage 7's "
                            "scheduler and measures it."] if estimated and not args.measure else [])
                        + (prefix_row.prefix_note(prefix_hits) if prefix_hits else [])))
    return 0
