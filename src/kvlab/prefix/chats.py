"""Multi-turn chats in real text, rendered with a model's own chat template.

A chat service re-sends the whole conversation every turn (system prompt, earlier questions, the
model's own answers, the new question): where a prefix cache earns its keep on real traffic (the
Mooncake paper's multi-turn traces, notebook 06). `run_chats` plays chats turn by turn, interleaved
like concurrent users; the caller's `serve_turn` decides how a turn is served (notebook 06's
`LLMEngine`, or `scripts/smollm2_prefix_hits.py`'s replay through the KV manager). SmolLM2's ChatML
template starts every chat with the same system prompt, so even first turns share a block; the tiny
model gets a plain "User: / Assistant:" transcript (meaningless answers, real cache hits).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Sequence

__all__ = ["FIRST_QUESTIONS", "FOLLOW_UPS", "ChatTurn", "question", "render_chat", "run_chats"]

FIRST_QUESTIONS = (
    "What is a KV cache in a language model?",
    "How do I keep bread fresh for longer?",
    "Why is the sky blue?",
    "Give me three tips for learning a new language.",
    "What does a Python list comprehension do?",
    "How far away is the Moon?",
    "What is the difference between a virus and a bacterium?",
    "How do I make a cup of green tea?",
)
FOLLOW_UPS = ("Can you give an example?", "Summarize that in one sentence.",
              "Why does that matter?", "Tell me one more thing about it.")

# serve_turn(prompts) -> answers: one list of generated token ids per prompt, in the same order.
ServeTurn = Callable[[list[list[int]]], Sequence[Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """One turn of one chat: prompt_text ends where the reply begins; answer_ids include a
    generated stop token, reply (what the next turn re-sends) leaves it out."""

    chat: int
    turn: int
    question: str
    prompt_text: str
    prompt_ids: list[int]
    answer_ids: list[int]
    reply: str


def question(chat: int, turn: int) -> str:
    """A first question per chat, then follow-ups rotated so no two chats ask the same at a turn."""
    if turn == 0:
        return FIRST_QUESTIONS[chat % len(FIRST_QUESTIONS)]
    return FOLLOW_UPS[(turn - 1 + chat) % len(FOLLOW_UPS)]


def render_chat(messages: Sequence[dict[str, str]], chat_template: Any | None = None) -> str:
    """The prompt, ending where the next reply begins: the `ChatTemplate`'s, or without one a
    'Role: content' line per message (content stripped), then 'Assistant:'. ValueError: a message
    without 'role' and 'content'."""
    if chat_template is not None:
        return chat_template.render(messages)
    lines = []
    for index, message in enumerate(messages):
        if not {"role", "content"} <= set(message):
            raise ValueError(f"message {index} needs 'role' and 'content', got {sorted(message)}")
        # Stripped: a reply the model began with a space reads back as the same text.
        lines.append(f"{message['role'].capitalize()}: {message['content'].strip()}\n")
    return "".join(lines) + "Assistant:"


def run_chats(serve_turn: ServeTurn, tokenizer, chat_template: Any | None = None,
              num_chats: int = 3, num_turns: int = 2,
              eos_token_id: int | Collection[int] | None = None) -> list[list[ChatTurn]]:
    """turns[turn][chat] of num_chats chats, each turn's prompts served together; each reply,
    decoded without the eos_token_id(s), joins its chat's history. ValueError: a count < 1, or
    serve_turn returned a different number of answers than prompts."""
    for name, value in (("num_chats", num_chats), ("num_turns", num_turns)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    histories: list[list[dict[str, str]]] = [[] for _ in range(num_chats)]
    turns = []
    for turn in range(num_turns):
        asked = [question(chat, turn) for chat in range(num_chats)]
        messages = [history + [{"role": "user", "content": text}]
                    for history, text in zip(histories, asked)]
        texts = [render_chat(m, chat_template) for m in messages]
        prompts = [tokenizer.encode(text).ids for text in texts]
        answers = [list(answer) for answer in serve_turn(prompts)]
        if len(answers) != num_chats:
            raise ValueError(f"serve_turn returned {len(answers)} answers for {num_chats} prompts")
        this_turn = []
        for chat, answer in enumerate(answers):
            reply = tokenizer.decode([t for t in answer if t not in stop])
            histories[chat] = messages[chat] + [{"role": "assistant", "content": reply}]
            this_turn.append(ChatTurn(chat, turn, asked[chat], texts[chat], prompts[chat], answer,
                                      reply))
        turns.append(this_turn)
    return turns
