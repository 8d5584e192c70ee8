"""Generated shared-prefix workloads for the tiny model, with every parameter stated.

Three shapes of traffic whose prompts share prefixes, as chat services see them:

* `system_prompt_workload`: every request starts with the same long system prompt, then a short
  user message of its own. The ideal hit is the system prompt, rounded down to whole blocks.
* `few_shot_workload`: an instruction and k worked examples ("shots") shared by every request,
  then the request's own question.
* `multi_turn_workload`: chats of several turns; turn t's prompt is the whole conversation so far
  (system prompt, earlier user messages and answers) plus the new user message, so it starts with
  turn t - 1's prompt. Chats are interleaved turn by turn, as concurrent users are.

Token ids are drawn uniformly from [0, vocab_size) by `random.Random(seed)`: the same seed gives the
same prompts on every platform. They are not text, so the model's answers to them are not
meaningful; that does not matter to a cache, which only compares ids, and the outputs are still
compared token for token with the cache on and off.

What these do not match: real prompts are not uniform ids; in a real multi-turn chat the previous
*answer* is the model's own output (whose blocks the engine caches during decode), here it is a
drawn stand-in of `answer_len` tokens, so only the prompt part of each earlier turn can hit. Real
prefix sharing is measured on the Mooncake traces (`trace_hit_rate`).
"""

from __future__ import annotations

import dataclasses
import random

__all__ = ["PromptWorkload", "system_prompt_workload", "few_shot_workload",
           "multi_turn_workload"]


@dataclasses.dataclass(frozen=True)
class PromptWorkload:
    """Token-id prompts and the parameters that made them.

    Attributes:
        name: 'system-prompt', 'few-shot' or 'multi-turn'.
        prompts: token ids of each request, in arrival order.
        max_new_tokens: tokens to generate per request.
        parameters: every argument of the generator (for printing next to a result).
    """

    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    parameters: dict

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_range(name: str, low_high: tuple[int, int]) -> None:
    low, high = low_high
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {low_high!r}")


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def system_prompt_workload(num_requests: int = 8, system_len: int = 64,
                           user_len: tuple[int, int] = (8, 24), max_new_tokens: int = 8,
                           vocab_size: int = 2048, seed: int = 0) -> PromptWorkload:
    """`num_requests` prompts = one shared system prompt of `system_len` tokens + a user message of
    a length drawn uniformly from `user_len` (inclusive).

    Raises:
        ValueError: a count < 1 or a bad range.
    """
    _check_positive(num_requests=num_requests, system_len=system_len,
                    max_new_tokens=max_new_tokens, vocab_size=vocab_size)
    _check_range("user_len", user_len)
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab_size)
    prompts = [system + _tokens(rng, rng.randint(*user_len), vocab_size)
               for _ in range(num_requests)]
    return PromptWorkload("system-prompt", prompts, max_new_tokens, dict(
        num_requests=num_requests, system_len=system_len, user_len=user_len,
        max_new_tokens=max_new_tokens, vocab_size=vocab_size, seed=seed))


def few_shot_workload(num_requests: int = 8, instruction_len: int = 16, num_shots: int = 4,
                      shot_len: int = 24, query_len: tuple[int, int] = (8, 16),
                      max_new_tokens: int = 8, vocab_size: int = 2048,
                      seed: int = 0) -> PromptWorkload:
    """Prompts = an instruction (`instruction_len`) + `num_shots` examples of `shot_len` tokens,
    all shared, + the request's own query (length uniform in `query_len`).

    Raises:
        ValueError: a count < 1 or a bad range.
    """
    _check_positive(num_requests=num_requests, instruction_len=instruction_len,
                    num_shots=num_shots, shot_len=shot_len, max_new_tokens=max_new_tokens,
                    vocab_size=vocab_size)
    _check_range("query_len", query_len)
    rng = random.Random(seed)
    shared = _tokens(rng, instruction_len, vocab_size)
    for _ in range(num_shots):
        shared += _tokens(rng, shot_len, vocab_size)
    prompts = [shared + _tokens(rng, rng.randint(*query_len), vocab_size)
               for _ in range(num_requests)]
    return PromptWorkload("few-shot", prompts, max_new_tokens, dict(
        num_requests=num_requests, instruction_len=instruction_len, num_shots=num_shots,
        shot_len=shot_len, query_len=query_len, max_new_tokens=max_new_tokens,
        vocab_size=vocab_size, seed=seed))


def multi_turn_workload(num_chats: int = 3, num_turns: int = 4, system_len: int = 32,
                        user_len: tuple[int, int] = (8, 16), answer_len: int = 16,
                        max_new_tokens: int = 8, vocab_size: int = 2048,
                        seed: int = 0) -> PromptWorkload:
    """`num_chats` chats of `num_turns` turns, interleaved (chat 0 turn 0, chat 1 turn 0, ...).

    Each chat has its own system prompt of `system_len` tokens; turn t's prompt is the chat's
    history (system prompt, then per earlier turn its user message and an `answer_len`-token
    answer) followed by a new user message (length uniform in `user_len`).

    Raises:
        ValueError: a count < 1 or a bad range.
    """
    _check_positive(num_chats=num_chats, num_turns=num_turns, system_len=system_len,
                    answer_len=answer_len, max_new_tokens=max_new_tokens, vocab_size=vocab_size)
    _check_range("user_len", user_len)
    rng = random.Random(seed)
    histories = [_tokens(rng, system_len, vocab_size) for _ in range(num_chats)]
    prompts = []
    for _ in range(num_turns):
        for chat, history in enumerate(histories):
            prompt = history + _tokens(rng, rng.randint(*user_len), vocab_size)
            prompts.append(prompt)
            histories[chat] = prompt + _tokens(rng, answer_len, vocab_size)
    return PromptWorkload("multi-turn", prompts, max_new_tokens, dict(
        num_chats=num_chats, num_turns=num_turns, system_len=system_len, user_len=user_len,
        answer_len=answer_len, max_new_tokens=max_new_tokens, vocab_size=vocab_size, seed=seed))
