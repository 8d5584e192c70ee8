"""Generated shared-prefix workloads for the tiny model, with every parameter stated.

Three shapes of shared-prefix traffic: one system prompt before each user message (the ideal hit:
the system prompt in whole blocks); an instruction and k examples ("shots") before each question;
multi-turn chats, interleaved like concurrent users, turn t's prompt starting with turn t - 1's.
Ids are uniform in [0, vocab_size) from `random.Random(seed)`, the same on every platform; not
text, so the answers mean nothing, but a cache only compares ids and outputs are still compared
with the cache on and off. Unlike real chats, an earlier answer is a drawn stand-in of
`answer_len` tokens, not the model's output; real sharing is measured on the Mooncake traces.
"""

from __future__ import annotations

import dataclasses
import random

__all__ = ["PromptWorkload", "system_prompt_workload", "few_shot_workload",
           "multi_turn_workload"]


@dataclasses.dataclass(frozen=True)
class PromptWorkload:
    """Prompts in arrival order, and the generator's `parameters` (printed beside a result)."""

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
    """A shared system prompt + a user message of uniform length in `user_len` (inclusive).
    ValueError: a count < 1 or a bad range (as for every workload here)."""
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
    """A shared instruction and `num_shots` examples + the request's own query."""
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
    """Chats interleaved (chat 0 turn 0, chat 1 turn 0, ...), each with its own system prompt;
    turn t's prompt: the history (earlier user messages, `answer_len`-token answers) + a new one."""
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
