"""`kvlab generate --cache prefix`: several prompts in one call through the prefix cache.

    kvlab generate --cache prefix --max-new-tokens 12 \
        --prompt "You answer briefly. Question: what is a list?" \
        --prompt "You answer briefly. Question: what is a dict?"

The prompts are admitted in the order given, so each one can hit the full blocks of the prompts
before it. Each completion is printed after its prompt, then one line of prefix-cache statistics:
hit rate (tokens hit / prompt tokens queried), blocks not computed, prefill tokens run, evictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..sizing import plural
from .engine import generate_with_prefix_cache

__all__ = ["generate_command", "format_prefix_line"]


def format_prefix_line(result) -> str:
    """One line: '-- prefix cache: block_size 16, hit rate 40.5% (96 of 237 prompt tokens), ...'."""
    prefix, paged = result.prefix_stats, result.stats
    return (f"-- prefix cache: block_size {result.cache.block_size}, hit rate "
            f"{prefix.hit_rate:.1%} ({prefix.num_hit_tokens} of {prefix.num_query_tokens} prompt "
            f"tokens), {plural(prefix.num_hit_blocks, 'block')} not computed, prefill ran "
            f"{plural(paged.num_prefill_tokens, 'token')}, "
            f"{plural(prefix.num_evictions, 'eviction')}, "
            f"{plural(paged.num_preemptions, 'preemption')}")


def generate_command(args: argparse.Namespace, model, tokenizer, prompts: list[list[int]],
                     attention_backend=None) -> int:
    """Run `kvlab generate --cache prefix` on already tokenized prompts and print the result.

    Raises:
        ValueError: a prompt the engine rejects (too long, bad token ids); the message names it.
    """
    result = generate_with_prefix_cache(
        model, prompts, args.max_new_tokens, block_size=args.block_size or 16,
        max_model_len=args.max_model_len, n=args.n, temperature=args.temperature,
        seed=args.seed, attention_backend=attention_backend)
    for error in result.errors:
        if error:
            raise ValueError(error)
    texts = ([[tokenizer.decode(ids) for ids in completions] for completions in result.completions]
             if tokenizer is not None else None)
    if args.json:
        print(json.dumps({
            "prompts": [{"prompt_ids": prompt,
                         "completions": [{"token_ids": ids,
                                          "text": texts[p][i] if texts else None}
                                         for i, ids in enumerate(completions)]}
                        for p, (prompt, completions) in enumerate(zip(prompts,
                                                                      result.completions))],
            "stats": dataclasses.asdict(result.stats),
            "prefix_stats": {**dataclasses.asdict(result.prefix_stats),
                             "hit_rate": result.prefix_stats.hit_rate}}))
        return 0
    for p, (prompt, completions) in enumerate(zip(prompts, result.completions)):
        for i, ids in enumerate(completions):
            label = f"[{p}]" if args.n == 1 else f"[{p}.{i}]"
            if texts is not None:
                print(f"{label} {tokenizer.decode(prompt)}{texts[p][i]}")
            else:
                print(f"{label} " + " ".join(map(str, ids)))
    print(format_prefix_line(result))
    return 0
