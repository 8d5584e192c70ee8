"""`kvlab serve`: replay a trace through each KV-cache strategy under one memory budget.

    kvlab serve --trace AzureLLMInferenceTrace_conv.csv --simulate --model llama-3.1-70b \\
        --gpu H100-80GB --tp 4 --speedup 10
    kvlab serve --trace AzureLLMInferenceTrace_conv.csv --model tiny --kv-budget 0.004 \\
        --num-requests 200 --shrink 8 --speedup 100

`--simulate` times each step with the card's cost model (`--clock`: `calibrated`, the roofline
derated to published measurements, or `roofline`, a lower bound; `kvlab.calibration.clock`); model
mode runs the real model with real cache tensors. Step budgets default to vLLM v1's API server's
(`scheduler_defaults`); without --tp a simulation takes the smallest tensor-parallel size that fits
and says why. A flag the mode would not use is refused (`check_flags`), never ignored.
"""

from __future__ import annotations

import argparse
import gc
import os
import json

from .arguments import (check_lengths, float_up_to, positive_float, positive_int, refuse_together,
                        resolve_tp)

__all__ = ["register", "run_serve", "scheduler_defaults"]

# vLLM v1's API-server defaults (vllm/engine/arg_utils.py, `EngineArgs._set_default_args_v1`,
# later `get_batch_defaults`): cards with >= 70 GiB other than the A100 get the large pair; an
# A100 stays on the small one because a larger token budget lowered its throughput (vLLM PR
# #17885). vLLM's offline `LLM` class doubles the token budget (16,384 / 8,192); a server is what
# `kvlab serve` models. Later vLLM releases add tiers in between; this is the two-tier rule.
LARGE_CARD_GIB = 70
LARGE_CARD_DEFAULTS = (1024, 8192)   # (max_num_seqs, max_num_batched_tokens)
OTHER_DEFAULTS = (256, 2048)
SIMULATED_MAX_MODEL_LEN = 4096  # --simulate's default, capped at the model's limit


def scheduler_defaults(card_name: str | None, memory_bytes: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of vLLM v1's API server on this card (nominal
    memory_bytes); no card (the model runs on the CPU) gets the small pair."""
    if card_name is None or memory_bytes is None:
        return OTHER_DEFAULTS
    if memory_bytes >= LARGE_CARD_GIB * 2**30 and "a100" not in card_name.lower():
        return LARGE_CARD_DEFAULTS
    return OTHER_DEFAULTS


def register(commands) -> None:
    """Add `kvlab serve` to the argparse subparsers (imports nothing heavy)."""
    from ..traces.shipped import SHIPPED_TRACES  # a dict of names: no torch

    p = commands.add_parser(
        "serve", help="serve a trace with every KV-cache strategy (stage 7)",
        description="Replay a request trace through one continuous-batching scheduler for each "
                    "KV-cache strategy. Step budgets default to vLLM v1's API-server values for "
                    "the card: max_num_seqs 1024 and max_num_batched_tokens 8192 on a card of "
                    ">= 70 GiB that is not an A100 (H100-80GB, H200, MI300X), 256 and 2048 on "
                    "any other card and on the CPU.")
    p.add_argument("--trace", required=True,
                   help=f"a shipped trace ({', '.join(SHIPPED_TRACES)}) or a file: Azure .csv "
                        f"(TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake .jsonl")
    p.add_argument("--strategy", choices=("contiguous", "paged", "prefix", "paged+prefix", "all"),
                   default="all",
                   help="one strategy, or all (default); prefix and paged+prefix are the same "
                        "(the tables call it paged+prefix: kvlab.report.SERVING_STRATEGY)")
    p.add_argument("--simulate", action="store_true",
                   help="no tensors: step times from a cost model of the card (--clock; default: "
                        "run the model)")
    p.add_argument("--model", default=None,
                   help="preset or HF config/checkpoint folder (default: llama-3.1-70b with "
                        "--simulate, else tiny)")
    p.add_argument("--clock", choices=("roofline", "calibrated"), default=None,
                   help="--simulate only: step times from the card's roofline (a lower bound) or "
                        "calibrated to published measurements of vLLM, TensorRT-LLM and SGLang "
                        "(default; kvlab.calibration.clock)")
    p.add_argument("--gpu", default=None, help="--simulate only: the card for the cost model and "
                                               "the default budget (default H100-80GB)")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="--simulate only: tensor-parallel GPUs (default: the smallest number at "
                        "which each GPU holds its share of the weights and one max_model_len "
                        "request's KV; the output says which)")
    p.add_argument("--kv-budget", type=positive_float, metavar="GIB", default=None,
                   help="KV memory per GPU in GiB (required in model mode; default with "
                        "--simulate: gpu_memory_utilization x card - weights)")
    p.add_argument("--gpu-memory-utilization", type=float_up_to(1.0), default=None,
                   help="--simulate without --kv-budget: the share of the card the server may "
                        "use (vLLM's default 0.9)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="weights and KV dtype (default: bf16 simulated, the model's own otherwise)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest request; longer ones are rejected; at most the model's "
                        "max_position_embeddings (default: 4096 or that limit if smaller with "
                        "--simulate, the limit in model mode)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="most requests running at once (default: 1024 on a card of >= 70 GiB "
                        "other than an A100, else 256; vLLM v1's API-server rule)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="most tokens computed in one step; longer prompts are prefilled in "
                        "chunks (default: 8192 on a card of >= 70 GiB other than an A100, else "
                        "2048)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block of the paged strategies (default 16, vLLM's)")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="replay only the first N requests of the trace")
    p.add_argument("--speedup", type=positive_float, default=None,
                   help="arrivals N times faster than the trace (the load of N such services)")
    p.add_argument("--rate", type=positive_float, default=None,
                   help="replace the trace's arrival times by a Poisson process of this many "
                        "requests/s (not with --speedup)")
    p.add_argument("--shrink", type=positive_int, default=1,
                   help="divide prompt and output lengths by N (the tiny model on a CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="model mode only: where the model runs (default: the GPU when there is "
                        "one, else the CPU; $KVLAB_DEVICE overrides)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of --rate's arrivals and model mode's prompt tokens (default 0)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_serve)


def check_flags(args: argparse.Namespace) -> None:
    """ValueError for a flag this mode would ignore or another overrides; fills in block_size."""
    refuse_together(args, "--speedup", "--rate",
                    "--rate replaces the trace's arrival times, so there is nothing to speed up")
    if args.strategy == "contiguous" and args.block_size is not None:
        raise ValueError(f"--block-size {args.block_size}: the contiguous strategy reserves "
                         f"max_model_len slabs, not blocks; drop --block-size or add a paged "
                         f"--strategy")
    args.block_size = args.block_size or 16
    if args.simulate:
        refuse_together(args, "--kv-budget", "--gpu-memory-utilization",
                        "--gpu-memory-utilization only sets the default KV budget, which "
                        "--kv-budget replaces")
        if args.device is not None:
            raise ValueError(f"--device {args.device}: --simulate runs no model (the roofline of "
                             f"--gpu times each step); drop --device, or --simulate to run the "
                             f"model")
        if args.seed is not None and args.rate is None:
            raise ValueError(f"--seed {args.seed}: a simulation without --rate draws nothing at "
                             f"random (the seed draws --rate's Poisson arrivals)")
        return
    if args.clock is not None:
        raise ValueError(f"--clock {args.clock}: model mode times each step with the wall clock "
                         f"of the model it runs; --clock needs --simulate")
    for flag, value in (("--gpu", args.gpu), ("--gpu-memory-utilization",
                                               args.gpu_memory_utilization)):
        if value is not None:
            raise ValueError(f"{flag} {value}: model mode runs the model on --device and takes "
                             f"its KV budget from --kv-budget; {flag} needs --simulate")
    if args.tp not in (None, 1):
        raise ValueError(f"--tp {args.tp}: model mode runs the model on one device; tensor "
                         f"parallelism needs --simulate")
    if args.kv_budget is None:
        raise ValueError("model mode needs --kv-budget GIB (the KV memory of the cache tensors); "
                         "or add --simulate")


def run_serve(args: argparse.Namespace) -> int:
    from ..report import SERVING_STRATEGY
    from .. import serving as req
    from ..serving.metrics import HIT_NOTE, format_rows
    from ..serving.strategies import STRATEGIES
    from ..traces import load_trace

    check_flags(args)
    strategy = SERVING_STRATEGY.get(args.strategy, args.strategy)  # paged+prefix -> prefix
    strategies = STRATEGIES if strategy == "all" else (strategy,)
    rows = load_trace(args.trace, args.num_requests)
    if not rows:
        raise ValueError(f"{args.trace}: no requests in the trace")
    requests = req.from_sizes(rows)
    workload = f"{args.trace}: {len(requests):,} requests"
    if args.shrink > 1:
        requests = req.shrink(requests, args.shrink)
        workload += f", lengths / {args.shrink}"
    if args.rate is not None:
        requests = req.poisson_arrivals(requests, args.rate, seed=args.seed or 0)
        workload += f", Poisson arrivals at {args.rate:g} req/s"
    elif args.speedup is not None:
        requests = req.speed_up(requests, args.speedup)
        workload += f", arrivals {args.speedup:g}x faster"

    if args.simulate:
        setup, results = _simulate(args, requests, strategies)
    else:
        setup, results = _run_model(args, requests, strategies)
    if args.json:
        print(json.dumps({**setup, "workload": workload, "max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "rows": [r.row() for r in results]}, indent=2))
        return 0
    print(f"{setup['description']}\nworkload {workload}; max_model_len {setup['max_model_len']:,}"
          f"{setup['max_model_len_note']}, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens:,}, block_size {args.block_size}\n")
    print(format_rows(results))
    if any(r.prefix_hit_rate is not None for r in results):
        print(HIT_NOTE)
    if setup.get("clock_note"):
        print(setup["clock_note"])
    wall = sum(r.wall_s for r in results)
    events = sum(r.events_per_s * r.wall_s for r in results)
    print(f"\nreplayed in {wall:.1f} s ({events / wall:,.0f} request-steps/s); times are "
          f"{setup['clock']}")
    if results and results[0].reject_examples:
        print(f"rejected, e.g. {results[0].reject_examples[0]}")
    return 0


def _simulate(args, requests, strategies):
    from ..config import load_config
    from ..calibration.clock import clock_cost_model, clock_note, describe_card, describe_clock
    from ..gpus import get_card
    from ..lazy_decode import serve
    from ..serving.engine_core import SimulatedExecutor
    from ..serving.strategies import simulated_manager
    from ..sizing import default_kv_budget, format_bytes, kv_bytes_per_token

    config = load_config(args.model or "llama-3.1-70b")
    dtype = args.dtype or "bf16"
    card = get_card(args.gpu or "H100-80GB")
    max_model_len, max_model_len_note = _max_model_len(args, config, SIMULATED_MAX_MODEL_LEN)
    given_budget = None if args.kv_budget is None else int(args.kv_budget * 2**30)
    utilization = args.gpu_memory_utilization or 0.9
    tp, tp_chosen = resolve_tp(args.tp, config, card.name, card.memory_bytes,
                               max_model_len=max_model_len, dtype=dtype,
                               gpu_memory_utilization=utilization, kv_budget_bytes=given_budget)
    clock = args.clock or "calibrated"
    cost = clock_cost_model(config, card.name, tp, dtype, clock)
    per_token = kv_bytes_per_token(config, dtype, tp)
    # vLLM's default: gpu_memory_utilization x the card - the weights (per GPU)
    budget = given_budget if given_budget is not None else default_kv_budget(
        config, card.name, dtype=dtype, tp=tp, gpu_memory_utilization=utilization)
    scheduler = _scheduler_config(args, card.name, card.memory_bytes)
    # A replay drops millions of small objects while tens of thousands live on, which CPython's
    # cyclic collector would walk over and over (a third of the whole Mooncake prefix replay). The
    # only cycles, each pool's doubly linked free block queue, are collected after the replays.
    gc.disable()
    try:
        results = [serve(requests, simulated_manager(name, budget, per_token, max_model_len,
                                                     args.block_size),
                         SimulatedExecutor(cost), scheduler, per_token, progress=not args.json)
                   for name in strategies]
    finally:
        gc.enable()
    description = (f"simulated: {describe_card(cost)}\n{describe_clock(cost)}\n"
                   + (f"{tp_chosen}\n" if tp_chosen else "")
                   + f"KV budget {format_bytes(budget)} per GPU = "
                   f"{budget // per_token:,} tokens of {format_bytes(per_token)}")
    setup = {"mode": "simulate", "model": config.name, "dtype": dtype, "gpu": card.name,
             "tp": tp, "tp_chosen_because": tp_chosen, "kv_budget_bytes": budget,
             "kv_bytes_per_token": per_token, "max_model_len": max_model_len,
             "max_model_len_note": max_model_len_note, "description": description,
             "clock": f"the {clock} clock's (kvlab.calibration.clock)", "clock_name": clock,
             "clock_note": clock_note(clock)}
    return setup, results


def _run_model(args, requests, strategies):
    import torch

    from ..checkpoint import load_model
    from ..device import default_dtype, resolve_device
    from ..dtypes import torch_dtype
    from ..workload import synthetic_prompt_ids
    from ..serving.engine_core import serve
    from ..serving.strategies import model_strategy
    from ..sizing import format_bytes, local_gpu_memory
    from .generate import default_threads

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu)")
    device = resolve_device(args.device)  # no --device: the GPU if there is one ($KVLAB_DEVICE)
    dtype = torch_dtype(args.dtype) if args.dtype else default_dtype(device)
    model = load_model(args.model or "tiny", dtype=dtype, device=device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
        torch.set_num_threads(default_threads(model, torch.get_num_threads()))
    max_model_len, max_model_len_note = _max_model_len(args, model.config,
                                                       model.config.max_position_embeddings)
    for request in requests:
        request.prompt_token_ids = synthetic_prompt_ids(request, model.config.vocab_size,
                                                        args.seed or 0)
    budget = int(args.kv_budget * 2**30)
    gpu = local_gpu_memory() if device.type == "cuda" else None  # the card the model runs on
    scheduler = _scheduler_config(args, gpu and gpu.name, gpu and gpu.total_bytes)
    results = []
    for name in strategies:
        kv, executor = model_strategy(name, model, budget, max_model_len, args.block_size)
        results.append(serve(requests, kv, executor, scheduler, executor.bytes_per_token,
                             progress=not args.json))
    description = (f"model mode: {model.config.name} ({str(dtype).removeprefix('torch.')}) on "
                   f"{device}, KV budget {format_bytes(budget)}")
    setup = {"mode": "model", "model": model.config.name, "dtype": str(dtype), "gpu": None,
             "device": str(device), "kv_budget_bytes": budget, "max_model_len": max_model_len,
             "max_model_len_note": max_model_len_note, "description": description,
             "clock": f"measured wall-clock time on {device}"}
    return setup, results


def _max_model_len(args, config, default: int) -> tuple[int, str]:
    """--max-model-len (`check_lengths`), or `default` capped at the model's limit, with a note."""
    limit = config.max_position_embeddings
    if args.max_model_len is None and default >= limit:
        max_model_len, note = limit, f" ({config.name}'s max_position_embeddings)"
    else:
        max_model_len, note = args.max_model_len or default, ""
    check_lengths(config, max_model_len, args.block_size)
    return max_model_len, note


def _scheduler_config(args, card_name, memory_bytes):
    """The step budgets: the flags, else vLLM's default for the card (written back to `args`).
    ValueError: max_num_batched_tokens < max_num_seqs (vLLM's SchedulerConfig refuses it too)."""
    from ..serving.scheduler import SchedulerConfig

    max_num_seqs, max_num_batched_tokens = scheduler_defaults(card_name, memory_bytes)
    if args.max_num_seqs is None:
        args.max_num_seqs = max_num_seqs
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max_num_batched_tokens
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise ValueError(f"max_num_batched_tokens {args.max_num_batched_tokens:,} < max_num_seqs "
                         f"{args.max_num_seqs:,}: a step could not give each running request its "
                         f"decode token; raise --max-num-batched-tokens or lower --max-num-seqs")
    return SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens)
