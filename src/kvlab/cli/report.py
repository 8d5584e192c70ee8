"""`kvlab report`: replay real (or synthetic) traffic through every cache strategy (the main job).

    kvlab report --model llama-3.1-8b --gpu H100-80GB
"""

from __future__ import annotations

import argparse
import json

from ..config import load_config
from ..sizing import GPU_MEMORY_GIB, MAX_SEQ_LEN, format_bytes
from .arguments import DTYPES, float_up_to, int_up_to

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
                               "(prefix hashes: adds a paged+prefix row), or a CSV file "
                               "TIMESTAMP,ContextTokens,GeneratedTokens")
    workload.add_argument("--synthetic", action="store_true",
                          help="draw from the log-normal fit to the conversation trace instead "
                               "(matches mean and median; its tail is far thinner)")
    rep.add_argument("--max-model-len", type=int_up_to(MAX_SEQ_LEN), default=4096)
    rep.add_argument("--num-requests", type=int_up_to(1_000_000), default=None,
                     help="requests to draw (synthetic, default 10000) or read (trace, default all)")
    budget = rep.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget", type=float_up_to(16384), metavar="GIB", default=None,
                        help="KV memory in GiB (default: gpu_memory_utilization x --gpu minus "
                             "the weights)")
    budget.add_argument("--gpu", default="H100-80GB",
                        help=f"the card whose memory sets the budget: one of "
                             f"{', '.join(GPU_MEMORY_GIB)} (nominal memory), or 'local' (what "
                             f"torch.cuda reports); default H100-80GB")
    rep.add_argument("--gpu-memory-utilization", type=float_up_to(1.0), default=0.9,
                     help="share of the GPU the server may use (vLLM's default 0.9)")
    rep.add_argument("--block-size", type=int_up_to(MAX_SEQ_LEN), default=16,
                     help="tokens per block of the paged strategy (vLLM's default 16)")
    rep.add_argument("--seed", type=int, default=0, help="seed of the synthetic draws")
    rep.add_argument("--measure", action="store_true",
                     help="also serve the workload through stage 7's scheduler (every request "
                          "queued at once) and print the requests each budget really holds")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report import ContiguousStrategy, PagedStrategy, format_report, measure_held, replay
    from ..sizing import default_kv_budget, gpu_memory, kv_bytes_per_token
    from ..traces import AZURE_TRACES, azure_trace, load_azure_trace
    from ..traces.shipped import trace_file
    from ..workload import synthetic_requests

    config = load_config(args.model)
    if args.max_model_len > config.max_position_embeddings:
        raise ValueError(f"--max-model-len {args.max_model_len:,} > the model's "
                         f"max_position_embeddings={config.max_position_embeddings:,}")
    if args.block_size > args.max_model_len:
        raise ValueError(f"--block-size {args.block_size:,} > --max-model-len "
                         f"{args.max_model_len:,}: one block would be longer than any request")
    kv_dtype = args.kv_cache_dtype or args.dtype
    if args.kv_budget is not None:
        budget, source = int(args.kv_budget * 2**30), "--kv-budget"
    else:  # vLLM's default: gpu_memory_utilization x the card, minus the weights
        card = gpu_memory(args.gpu)
        budget = default_kv_budget(config, dtype=args.dtype, gpu_memory_bytes=card.total_bytes,
                                   gpu_memory_utilization=args.gpu_memory_utilization)
        source = (f"{args.gpu_memory_utilization} x {format_bytes(card.total_bytes)} "
                  f"({card.name}, {card.source}) - {args.dtype} weights")
    per_token = kv_bytes_per_token(config, kv_dtype)
    prefix_hits = None
    if args.synthetic:
        requests = synthetic_requests(args.num_requests or 10_000, seed=args.seed)
        workload = "synthetic log-normal fit to the Azure conversation trace (thinner tail)"
    elif args.trace.startswith("mooncake-"):  # carries prefix hashes: adds paged+prefix
        from ..prefix import report_row as prefix_row

        requests, workload, prefix_hits = prefix_row.mooncake_report_workload(
            args.trace, budget, per_token, args.max_model_len, limit=args.num_requests)
    elif args.trace in (f"azure-{service}" for service in AZURE_TRACES):
        service = args.trace.removeprefix("azure-")
        requests = azure_trace(service, limit=args.num_requests)
        workload = f"Azure LLM inference trace 2023, {service} (shipped)"
    else:
        requests = load_azure_trace(trace_file(args.trace), limit=args.num_requests)
        workload = f"trace {args.trace}"
    strategies = []
    if config.num_key_value_heads < config.num_attention_heads:
        # The same model had it kept one KV head per query head (MHA): what GQA saves.
        mha = config.with_changes(num_key_value_heads=config.num_attention_heads)
        strategies.append(ContiguousStrategy(args.max_model_len, kv_bytes_per_token(mha, kv_dtype),
                                             name="contiguous-mha"))
    strategies += [ContiguousStrategy(args.max_model_len, per_token),
                   PagedStrategy(args.block_size, per_token)]
    if prefix_hits is not None:
        strategies.append(prefix_row.PrefixPagedStrategy(args.block_size, per_token))
    dtypes = args.dtype if kv_dtype == args.dtype else f"weights {args.dtype}, KV cache {kv_dtype}"
    report = replay(requests, strategies, args.max_model_len, budget, workload=workload,
                    model=f"{config.name} ({dtypes})", kv_budget_source=source)
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
