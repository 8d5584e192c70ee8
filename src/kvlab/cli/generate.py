"""`kvlab generate`: text from a model through a chosen KV cache (stages 2, 4, 5, 6).

    kvlab generate --model tiny --prompt "The" --max-new-tokens 20 --cache paged
    kvlab generate --model smollm2-135m --chat --prompt "What is the capital of France?" \
        --max-new-tokens 32        # the assistant's reply, rendered and stopped by the template
"""

from __future__ import annotations

import argparse
import os

from .arguments import positive_int
from .generate_output import Printed, print_generation

__all__ = ["register", "run", "default_threads"]


def register(commands) -> None:
    """Add `kvlab generate` to the argparse subparsers (imports nothing heavy)."""
    gen = commands.add_parser("generate", help="greedy generation with a chosen KV cache")
    gen.add_argument("--model", default="tiny",
                     help="'tiny', a HF Llama checkpoint folder, a *.gguf file, or 'smollm2-135m' "
                          "(after `kvlab fetch smollm2-135m`; 4-bit weights dequantized to floats)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="prompt text (with --chat: the user's message); repeat it for "
                             "several prompts, generated as one batch")
    prompt.add_argument("--prompt-ids", action="append",
                        help="prompt token ids, e.g. 1,2,3; repeatable like --prompt")
    gen.add_argument("--max-new-tokens", type=positive_int, required=True)
    gen.add_argument("--chat", action="store_true",
                     help="render each --prompt as a user message with the model's own chat "
                          "template and stop at its end-of-turn token; print only the reply")
    gen.add_argument("--system", default=None,
                     help="the system message (--chat; default: the template's own)")
    gen.add_argument("--cache", choices=("none", "contiguous", "paged", "prefix"),
                     default=None, help="default: contiguous for one prompt, paged for several "
                                        "(one batch); prefix: paged + prefix caching (stage 6)")
    gen.add_argument("--block-size", type=positive_int, default=None,
                     help="tokens per block (--cache paged / prefix only; default 16)")
    gen.add_argument("--n", type=positive_int, default=1,
                     help="completions of the prompt, sharing its blocks (--cache paged; needs "
                          "--temperature, or all n would be the same greedy text)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy (default); > 0 samples, so --n completions differ")
    gen.add_argument("--attention", choices=("torch", "triton"), default="torch",
                     help="paged attention: PyTorch gather + attend (default), or stage 5's Triton "
                          "kernels (on CPU in Triton's interpreter: slow) (--cache paged)")
    gen.add_argument("--kv-layout", choices=("token-major", "head-major"), default=None,
                     help="the block pool's layout (--cache paged; default token-major)")
    gen.add_argument("--seed", type=int, default=0,
                     help="the request's sampling seed: same prompt + seed, same samples")
    gen.add_argument("--max-model-len", type=positive_int, default=None,
                     help="tokens per request (prompt + output); default: the model's limit")
    gen.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="default: the GPU when there is one, else the CPU ($KVLAB_DEVICE "
                          "overrides; kvlab.device)")
    gen.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                     help="default: fp32 on cpu; bf16 on cuda (fp16 where bf16 is missing, e.g. T4)")
    gen.add_argument("--threads", type=positive_int, default=None,
                     help="CPU threads for torch; default $OMP_NUM_THREADS if set, else 1 for "
                          "models under 200 million parameters (tiny, smollm2-135m), torch's "
                          "default otherwise")
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..device import default_dtype, resolve_device

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu)")
    device = resolve_device(args.device)  # no --device: the GPU if there is one ($KVLAB_DEVICE)
    if args.attention == "triton" and device.type == "cpu":
        # No GPU: Triton's CPU interpreter. Triton reads it when a kernel is defined, and the
        # kernels are imported only when the backend is chosen, below.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from ..checkpoint import load_model, load_tokenizer
    from ..dtypes import torch_dtype
    from ..generate import chat, default_cache, generate

    num_prompts = len(args.prompt or args.prompt_ids)
    args.cache = args.cache or default_cache(num_prompts)
    chat_template = _chat_template(args)  # before the weights load: a refusal costs nothing
    if args.block_size is None:
        args.block_size = 16
    elif args.cache not in ("paged", "prefix"):
        raise ValueError(f"--block-size {args.block_size} sizes the blocks of the paged cache; "
                         f"add --cache paged (--cache {args.cache} has no blocks)")
    if args.n > 1 and args.temperature == 0:
        raise ValueError(f"--n {args.n} without --temperature would print {args.n} identical "
                         f"greedy completions; add e.g. --temperature 0.8 to sample them")
    if num_prompts > 1 and args.cache not in ("paged", "prefix"):
        raise ValueError(f"{num_prompts} prompts given: several prompts are one batch, which "
                         f"needs --cache paged or --cache prefix (--cache {args.cache} holds one "
                         f"sequence)")
    dtype = torch_dtype(args.dtype) if args.dtype else default_dtype(device)
    model = load_model(args.model, dtype=dtype, device=device)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
        torch.set_num_threads(default_threads(model, torch.get_num_threads()))
    tokenizer = None
    try:
        tokenizer = load_tokenizer(args.model)
    except FileNotFoundError:
        if args.prompt is not None:
            raise
    options = dict(cache=args.cache, max_model_len=args.max_model_len, n=args.n,
                   temperature=args.temperature, seed=args.seed, block_size=args.block_size,
                   attention_backend=_attention_backend(args))
    if args.chat:
        replies = chat(model, tokenizer, chat_template, args.prompt, args.max_new_tokens,
                       system=args.system, **options)
        shown = Printed(replies.prompt_ids, replies.prompt_texts, replies.replies, True,
                        replies.generation)
    else:
        prompts = _prompt_ids(args, tokenizer)
        result = generate(model, prompts if len(prompts) > 1 else prompts[0],
                          args.max_new_tokens, **options)
        if tokenizer is None:  # a checkpoint without tokenizer.json: ids in, ids out
            prompt_texts = texts = None
        else:
            prompt_texts = args.prompt or [tokenizer.decode(ids) for ids in prompts]
            texts = [[tokenizer.decode(ids) for ids in completions]
                     for completions in result.prompt_completions]
        shown = Printed(prompts, prompt_texts, texts, False, result)
    print_generation(args, shown)
    return 0


def _chat_template(args: argparse.Namespace):
    """The `ChatTemplate` for --chat, else None. ValueError: --system without --chat, --chat with
    --prompt-ids, or a model without a template."""
    if not args.chat:
        if args.system is not None:
            raise ValueError("--system sets the system message of a chat; add --chat")
        return None
    if args.prompt is None:
        raise ValueError("--chat renders --prompt text with the model's chat template; "
                         "--prompt-ids are already tokens: use --prompt")
    from ..checkpoint import load_chat_template

    try:
        return load_chat_template(args.model)
    except ValueError as error:  # ConfigError too: a GGUF file without tokenizer.chat_template
        raise ValueError(f"--chat needs the model's chat template: {error}; drop --chat to "
                         f"continue the prompt text as it is") from None


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Token ids of every --prompt (encoded) or --prompt-ids (parsed)."""
    if args.prompt is not None:
        return [tokenizer.encode(text).ids for text in args.prompt]
    try:
        return [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got "
                         f"{args.prompt_ids!r}") from None


# Below this many parameters a decode step's matmuls are too small to split across CPU threads.
# On a shared 2-core CPU (load ~4.5): the tiny model, 20 tokens, 4.2 s on 2 threads, 0.27 s on 1;
# SmolLM2-135M, 24 tokens, contiguous cache, median 31.8 s vs 5.6 s (4 interleaved runs each).
_SMALL_MODEL_PARAMETERS = 200_000_000


def default_threads(model, available: int) -> int:
    """1 thread for a small model, all of torch's default otherwise."""
    small = sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMETERS
    return 1 if small else available


def _attention_backend(args: argparse.Namespace):
    """The backend of --attention and --kv-layout (None: default); ValueError without paging."""
    passed = []  # only what the user typed: a default they never saw would confuse the message
    if args.attention != "torch":
        passed.append(f"--attention {args.attention}")
    if args.kv_layout is not None:
        passed.append(f"--kv-layout {args.kv_layout}")
    args.kv_layout = args.kv_layout or "token-major"
    if not passed:
        return None
    if args.cache not in ("paged", "prefix"):
        choose = "chooses" if len(passed) == 1 else "choose"
        raise ValueError(f"{' '.join(passed)} {choose} how the paged cache stores and reads K/V; "
                         f"--cache {args.cache} has no paged cache: add --cache paged")
    from ..paged.backends import resolve_backend

    return resolve_backend(args.attention, args.kv_layout)
