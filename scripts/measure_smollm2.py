"""Measure SmolLM2-135M-Instruct (4-bit GGUF, dequantized) in kvlab: load time, the largest logit
difference against transformers' load of the same file, and greedy decoding speed per KV-cache path.

    kvlab fetch smollm2-135m
    python scripts/measure_smollm2.py --new-tokens 32 [--json]

Timings are wall-clock seconds on whatever machine runs this (print them with that machine's
description); tokens/s = generated tokens / time for the whole request (prefill + decode).
Decoding one token reads every weight once (135 M float32 numbers = 540 MB), so on a CPU it is
bound by memory bandwidth, not arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from kvlab.checkpoint import load_chat_template, load_model, load_tokenizer
from kvlab.fetch import model_path
from kvlab.generate import generate

MODEL = "smollm2-135m"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); on a busy machine "
                             "1 avoids waiting on preempted pool threads for every small op")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                                f"torch threads {torch.get_num_threads()}",
                     "load_average_1min": os.getloadavg()[0]}
    model, results["load_seconds"] = timed(lambda: load_model(MODEL))
    tokenizer, results["tokenizer_seconds"] = timed(lambda: load_tokenizer(MODEL))
    prompt = tokenizer.encode(load_chat_template(MODEL).render(
        [{"role": "user", "content": "Explain what a KV cache is in one paragraph."}])).ids
    results["prompt_tokens"] = len(prompt)

    if not args.skip_transformers:
        import transformers

        path = model_path(MODEL)
        hf, results["transformers_load_seconds"] = timed(
            lambda: transformers.LlamaForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32).eval())
        with torch.no_grad():
            diff = (model(torch.tensor(prompt)) - hf(torch.tensor([prompt])).logits[0]).abs()
        results["max_abs_logit_difference"] = diff.max().item()

    new = args.new_tokens
    runs = {
        "none": lambda: generate(model, prompt, new, cache="none").token_ids,
        "contiguous": lambda: generate(model, prompt, new, cache="contiguous",
                                       max_model_len=len(prompt) + new).token_ids,
        "paged": lambda: generate(model, prompt, new, cache="paged", block_size=16,
                                  max_model_len=len(prompt) + new).token_ids,
    }
    outputs = {}
    for name, run in runs.items():
        outputs[name], seconds = timed(run)
        results[f"tokens_per_second_{name}"] = len(outputs[name]) / seconds
    results["same_tokens_all_paths"] = outputs["none"] == outputs["contiguous"] == outputs["paged"]
    results["text"] = tokenizer.decode(outputs["paged"])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for key, value in results.items():
            print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()
