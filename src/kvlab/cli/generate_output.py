"""What `kvlab generate` prints: completions as text (or ids, or --json), then the cache's counts.

Each completion prints after its prompt (with --chat: the reply alone), labelled [p], [i] or [p.i]
(prompt p, completion i) when there are several; then the paged cache's counts or the prefix
cache's hit rate (tokens hit / prompt tokens queried). --json has one shape (null: not applicable):

    {"prompts": [{"prompt_ids": [...], "prompt_text": str | null,
                  "completions": [{"token_ids": [...], "text": str | null}, ...]}, ...],
     "stats": {...} | null,          # the paged engine's counts (--cache paged / prefix)
     "prefix_stats": {...} | null}   # --cache prefix: hits, blocks not computed, evictions

prompt_text is the text prefilled (with --chat: the conversation rendered by the chat template);
with --chat a completion's text is the reply without its stop token, while token_ids keep it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..sizing import format_bytes, plural

__all__ = ["Printed", "print_generation", "generation_json", "format_prefix_line"]


@dataclasses.dataclass
class Printed:
    """What one call shows: texts[p][i] is completion i of prompt p (texts None without a
    tokenizer); chat replies print without their prompt; result is the `GenerationResult`."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str] | None
    texts: list[list[str]] | None
    chat: bool
    result: object


def generation_json(shown: Printed) -> dict:
    """The --json object (shape in the module docstring)."""
    result = shown.result
    prompts = []
    for p, (ids, completions) in enumerate(zip(shown.prompt_ids, result.prompt_completions)):
        prompts.append({
            "prompt_ids": ids,
            "prompt_text": shown.prompt_texts[p] if shown.prompt_texts else None,
            "completions": [{"token_ids": tokens,
                             "text": shown.texts[p][i] if shown.texts else None}
                            for i, tokens in enumerate(completions)]})
    prefix = result.prefix_stats
    return {"prompts": prompts,
            "stats": dataclasses.asdict(result.stats) if result.stats is not None else None,
            "prefix_stats": ({**dataclasses.asdict(prefix), "hit_rate": prefix.hit_rate}
                             if prefix is not None else None)}


def print_generation(args: argparse.Namespace, shown: Printed) -> None:
    """Print `kvlab generate`: every completion (or --json), then the cache's line(s)."""
    if args.json:
        print(json.dumps(generation_json(shown)))
        return
    result = shown.result
    completions = result.prompt_completions
    for p, prompt_completions in enumerate(completions):
        for i, ids in enumerate(prompt_completions):
            label = _label(p, i, len(completions), args.n)
            if shown.texts is None:
                print(label + " ".join(map(str, ids)))
            elif shown.chat:
                print(label + shown.texts[p][i])
            else:
                print(label + shown.prompt_texts[p] + shown.texts[p][i])
    if result.prefix_stats is not None:
        print(format_prefix_line(result, _attention(args)))
    elif result.stats is not None:
        print(paged_line(args, result))
        if args.n > 1:
            print(net_sharing_line(dataclasses.asdict(result.stats), args.n))


def _label(prompt: int, completion: int, num_prompts: int, n: int) -> str:
    """'' for one completion of one prompt, else '[i] ', '[p] ' or '[p.i] '."""
    if num_prompts == 1:
        return "" if n == 1 else f"[{completion}] "
    return f"[{prompt}] " if n == 1 else f"[{prompt}.{completion}] "


def paged_line(args: argparse.Namespace, result) -> str:
    """'-- paged cache: block_size 16, peak 3 blocks (...), ...': the paged engine's counts."""
    stats = result.stats
    peak = stats.peak_blocks_in_use
    return (f"-- paged cache: block_size {result.cache.block_size}, "
            f"peak {plural(peak, 'block')} ({format_bytes(peak * result.cache.block_bytes)}), "
            f"{stats.blocks_saved_by_sharing} saved by sharing the prompt, "
            f"{stats.num_cow_copies} copy-on-write copies, "
            f"{plural(stats.num_preemptions, 'preemption')}, attention {_attention(args)}")


def net_sharing_line(stats: dict, n: int) -> str:
    """Peak blocks of n completions sharing a prompt vs as n requests (`peak_blocks_unshared`)."""
    shared, unshared = stats["peak_blocks_in_use"], stats["peak_blocks_unshared"]
    saving = 1 - shared / unshared if unshared else 0.0
    return (f"-- vs {n} separate requests: peak {plural(unshared, 'block')} without sharing, "
            f"{plural(shared, 'block')} with it: {plural(unshared - shared, 'block')} "
            f"({saving:.0%}) saved net of copy-on-write")


def _attention(args: argparse.Namespace) -> str:
    """'torch (token-major)' or 'triton (head-major)': which paged-attention path ran."""
    return f"{args.attention} ({args.kv_layout or 'token-major'})"


def format_prefix_line(result, attention: str | None = None) -> str:
    """'-- prefix cache: block_size 16, hit rate 40.5% (96 of 237 prompt tokens), ...', then
    `attention` (e.g. 'triton (token-major)') if given."""
    prefix, paged = result.prefix_stats, result.stats
    named = f", attention {attention}" if attention else ""
    # A request back after a preemption hits its own blocks: counted apart, as vLLM does.
    readmitted = (f" and {prefix.num_readmitted_hit_tokens} at "
                  f"{plural(prefix.num_readmitted_lookups, 're-admission')}"
                  if prefix.num_readmitted_lookups else "")
    return (f"-- prefix cache: block_size {result.cache.block_size}, hit rate "
            f"{prefix.hit_rate:.1%} ({prefix.num_hit_tokens} of {prefix.num_query_tokens} prompt "
            f"tokens{readmitted}), {plural(prefix.num_hit_blocks, 'block')} not computed, "
            f"prefill ran "
            f"{plural(paged.num_prefill_tokens, 'token')}, "
            f"{plural(prefix.num_evictions, 'eviction')}, "
            f"{plural(paged.num_preemptions, 'preemption')}{named}")
