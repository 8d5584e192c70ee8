"""Prefix-cache hit rate on real multi-turn chats: SmolLM2-135M-Instruct and its own chat template.

    kvlab fetch smollm2-135m
    python scripts/smollm2_prefix_hits.py [--chats 4] [--turns 3] [--answer-tokens 32]

Chats run interleaved turn by turn, as concurrent users are. Turn t's prompt is the chat template
rendered over the whole conversation so far (default system prompt, earlier questions, the model's
own greedy answers) plus the new question. Each request is replayed through stage 6's
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
from kvlab.pretrained import load_course_model

FIRST_QUESTIONS = [
    "What is a KV cache in a language model?",
    "How do I keep bread fresh for longer?",
    "Why is the sky blue?",
    "Give me three tips for learning a new language.",
    "What does a Python list comprehension do?",
    "How far away is the Moon?",
    "What is the difference between a virus and a bacterium?",
    "How do I make a cup of green tea?",
]
FOLLOW_UPS = ["Can you give an example?", "Summarize that in one sentence.",
              "Why does that matter?", "Tell me one more thing about it."]


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
    tokenizer, template = loaded.tokenizer, loaded.chat_template
    manager = PrefixCachingKVCacheManager(num_blocks=8192, block_size=args.block_size)
    histories: list[list[dict]] = [[] for _ in range(args.chats)]
    per_turn = []
    start = time.perf_counter()
    for turn in range(args.turns):
        before = manager.prefix_stats
        for chat in range(args.chats):
            question = FIRST_QUESTIONS[chat % len(FIRST_QUESTIONS)] if turn == 0 else \
                FOLLOW_UPS[(turn - 1 + chat) % len(FOLLOW_UPS)]
            messages = histories[chat] + [{"role": "user", "content": question}]
            prompt = tokenizer.encode(template.render(messages)).ids
            answer = generate(loaded.model, prompt, args.answer_tokens, cache="contiguous",
                              eos_token_id=loaded.eos_token_id).token_ids
            seq = (chat, turn)
            manager.allocate_with_prefix(seq, prompt)
            if len(answer) > 1:  # K/V exists for every fed token: all but the last generated
                manager.append_slots(seq, len(answer) - 1, answer[:-1])
            manager.free(seq)
            reply = tokenizer.decode([t for t in answer if t != loaded.eos_token_id])
            histories[chat] = messages + [{"role": "assistant", "content": reply}]
        after = manager.prefix_stats
        queried = after.num_query_tokens - before.num_query_tokens
        hit = after.num_hit_tokens - before.num_hit_tokens
        per_turn.append((turn + 1, queried, hit))
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
    print(f"last prompt of chat 0:\n{template.render(histories[0][:-1])}")


if __name__ == "__main__":
    main()
