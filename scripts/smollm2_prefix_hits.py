"""Prefix-cache hit rate on real multi-turn chats: SmolLM2-135M-Instruct and its own chat template.

    kvlab fetch smollm2-135m
    python scripts/smollm2_prefix_hits.py [--chats 4] [--turns 3] [--answer-tokens 32]

Chats run interleaved turn by turn, as concurrent users are (`kvlab.prefix.chats.run_chats`, the
loop notebook 06 runs through the engine). Turn t's prompt is the chat template rendered over the
whole conversation so far (default system prompt, earlier questions, the model's own greedy
answers) plus the new question. Each request is replayed through stage 6's
`PrefixCachingKVCacheManager` (block_size 16, a pool large enough that nothing is evicted): its
prompt is looked up and admitted, the answer's tokens are appended (all but the last, whose K/V a
server never writes), then it finishes and its blocks stay cached. Hit rate = prompt tokens found in
the cache / prompt tokens queried; prefill saved = the tokens hit.

Two sources of hits: the default system prompt every conversation starts with (21 tokens: one full
block of 16), and, from turn 2 on, the earlier turns of the same chat, re-rendered verbatim.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlab.generate import generate
from kvlab.prefix import PrefixCachingKVCacheManager
from kvlab.prefix.chats import run_chats
from kvlab.pretrained import load_course_model
from kvlab.serving import Request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_course_model()
    if not loaded.is_pretrained:
        raise SystemExit(loaded.note)
    manager = PrefixCachingKVCacheManager(num_blocks=8192, block_size=args.block_size)
    per_turn = []

    def serve_turn(prompts: list[list[int]]) -> list[list[int]]:
        """Generate each answer, then replay the request through the manager alone."""
        before, answers = manager.prefix_stats, []
        for prompt in prompts:
            answer = generate(loaded.model, prompt, args.answer_tokens, cache="contiguous",
                              eos_token_id=loaded.eos_token_id).token_ids
            request = Request(("turn", len(per_turn), len(answers)), 0.0, len(prompt),
                              len(answer), list(prompt))
            blocks, computed = manager.get_computed_blocks(request)
            manager.allocate_slots(request, len(prompt) - computed, computed, blocks)
            if len(answer) > 1:  # K/V exists for every fed token: all but the last generated
                request.output_token_ids = list(answer[:-1])
                request.num_output_tokens = len(answer) - 1
                manager.allocate_slots(request, len(answer) - 1)
            manager.free(request)
            answers.append(answer)
        after = manager.prefix_stats
        per_turn.append((len(per_turn) + 1, after.num_query_tokens - before.num_query_tokens,
                         after.num_hit_tokens - before.num_hit_tokens))
        return answers

    start = time.perf_counter()
    turns = run_chats(serve_turn, loaded.tokenizer, loaded.chat_template, args.chats, args.turns,
                      loaded.eos_token_id)
    stats = manager.prefix_stats
    print(f"{loaded.note}")
    print(f"{args.chats} chats x {args.turns} turns, answers <= {args.answer_tokens} tokens "
          f"(greedy), block_size {args.block_size}, {time.perf_counter() - start:.0f} s")
    for turn, queried, hit in per_turn:
        print(f"turn {turn}: {queried:,} prompt tokens, {hit:,} found in the cache "
              f"({hit / queried:.1%})")
    print(f"all: hit rate {stats.hit_rate:.1%}, prefill {stats.num_query_tokens:,} -> "
          f"{stats.num_query_tokens - stats.num_hit_tokens:,} tokens "
          f"({stats.num_hit_blocks} blocks not computed), evictions {stats.num_evictions}")
    print(f"last prompt of chat 0:\n{turns[-1][0].prompt_text}")


if __name__ == "__main__":
    main()
