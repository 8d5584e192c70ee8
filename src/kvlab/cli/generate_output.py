"""What `kvlab generate` prints: completions as text (or ids, or --json), then the cache's counts.

    kvlab generate --cache prefix --max-new-tokens 12 \\
        --prompt "You answer briefly. Question: what is a list?" \\
        --prompt "You answer briefly. Question: what is a dict?"

With --cache prefix each prompt's completions are printed after it, then one line of prefix-cache
statistics: hit rate (tokens hit / prompt tokens queried), blocks not computed, prefill tokens
run, evictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..sizing import format_bytes, plural

__all__ = ["print_generation", "print_prefix_generation", "format_prefix_line"]


def print_generation(args: argparse.Namespace, result, prompt_ids: list[int], tokenizer) -> None:
    """Print `kvlab generate` for one prompt: its completion(s), then the paged cache's counts."""
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
              f"peak {plural(stats['peak_blocks_in_use'], 'block')} "
              f"({format_bytes(stats['peak_blocks_in_use'] * block_bytes)}), "
              f"{stats['blocks_saved_by_sharing']} saved by sharing the prompt, "
              f"{stats['num_cow_copies']} copy-on-write copies, "
              f"{plural(stats['num_preemptions'], 'preemption')}, attention {_attention(args)}")
        if args.n > 1:
            print(net_sharing_line(stats, args.n))


def net_sharing_line(stats: dict, n: int) -> str:
    """The net saving of n completions sharing one prompt against n separate requests, at peak.

    Separate requests would hold every block-table entry in a block of its own, so their peak is
    the most entries the tables had at once (`peak_blocks_unshared`)."""
    shared, unshared = stats["peak_blocks_in_use"], stats["peak_blocks_unshared"]
    saving = 1 - shared / unshared if unshared else 0.0
    return (f"-- vs {n} separate requests: peak {plural(unshared, 'block')} without sharing, "
            f"{plural(shared, 'block')} with it: {plural(unshared - shared, 'block')} "
            f"({saving:.0%}) saved net of copy-on-write")


def _attention(args: argparse.Namespace) -> str:
    """'torch (token-major)' or 'triton (head-major)': which paged-attention path ran."""
    return f"{args.attention} ({args.kv_layout or 'token-major'})"


def format_prefix_line(result, attention: str | None = None) -> str:
    """One line: '-- prefix cache: block_size 16, hit rate 40.5% (96 of 237 prompt tokens), ...'.

    `attention` (e.g. 'triton (token-major)'), when given, is named last: which path ran.
    """
    prefix, paged = result.prefix_stats, result.stats
    named = f", attention {attention}" if attention else ""
    return (f"-- prefix cache: block_size {result.cache.block_size}, hit rate "
            f"{prefix.hit_rate:.1%} ({prefix.num_hit_tokens} of {prefix.num_query_tokens} prompt "
            f"tokens), {plural(prefix.num_hit_blocks, 'block')} not computed, prefill ran "
            f"{plural(paged.num_prefill_tokens, 'token')}, "
            f"{plural(prefix.num_evictions, 'eviction')}, "
            f"{plural(paged.num_preemptions, 'preemption')}{named}")


def print_prefix_generation(args: argparse.Namespace, result, prompts: list[list[int]],
                            tokenizer) -> None:
    """Print `kvlab generate --cache prefix`: each prompt's completions, then the hit line."""
    texts = ([[tokenizer.decode(ids) for ids in completions]
              for completions in result.prompt_completions] if tokenizer is not None else None)
    if args.json:
        print(json.dumps({
            "prompts": [{"prompt_ids": prompt,
                         "completions": [{"token_ids": ids,
                                          "text": texts[p][i] if texts else None}
                                         for i, ids in enumerate(completions)]}
                        for p, (prompt, completions) in enumerate(zip(prompts,
                                                                      result.prompt_completions))],
            "stats": dataclasses.asdict(result.stats),
            "prefix_stats": {**dataclasses.asdict(result.prefix_stats),
                             "hit_rate": result.prefix_stats.hit_rate}}))
        return
    for p, (prompt, completions) in enumerate(zip(prompts, result.prompt_completions)):
        for i, ids in enumerate(completions):
            label = f"[{p}]" if args.n == 1 else f"[{p}.{i}]"
            if texts is not None:
                print(f"{label} {tokenizer.decode(prompt)}{texts[p][i]}")
            else:
                print(f"{label} " + " ".join(map(str, ids)))
    print(format_prefix_line(result, _attention(args)))
