"""Multi-turn chats in real text, rendered with a model's own chat template.

A chat service sends the whole conversation again at every turn: turn t's prompt is the chat
template rendered over the system prompt, the earlier questions, the model's own earlier answers,
and the new question. That is where a prefix cache earns its keep on real traffic (the Mooncake
paper's multi-turn traces in notebook 06). `run_chats` plays such conversations turn by
turn, interleaving the chats as concurrent users are; *how* a turn is served (an `LLMEngine` with
or without prefix caching, a replay through the KV manager alone) is the caller's `serve_turn`.

SmolLM2-Instruct's template (ChatML) starts every conversation with the same default system
prompt, so even first turns share a block. The tiny model has no chat template: `render_chat`
then writes a plain "User: ... / Assistant: ..." transcript, so the same code runs without the
SmolLM2 file (its answers are not meaningful, its cache hits are real).

Used by notebook 06 (SmolLM2 through `LLMEngine`, cache on and off) and
`scripts/smollm2_prefix_hits.py` (a replay through the KV manager alone).
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
    """One turn of one chat.

    Attributes:
        chat, turn: indices from 0.
        question: the user's message of this turn.
        prompt_text: the conversation so far rendered by `render_chat` (ends where the reply
            begins).
        prompt_ids: prompt_text as token ids (what the server prefills).
        answer_ids: the token ids the model generated (the stop token included if it was
            generated).
        reply: the answer as text, stop token left out (what the next turn re-sends).
    """

    chat: int
    turn: int
    question: str
    prompt_text: str
    prompt_ids: list[int]
    answer_ids: list[int]
    reply: str


def question(chat: int, turn: int) -> str:
    """The user's message of `turn` in `chat`: a first question per chat, then follow-ups that
    rotate so that no two chats ask the same thing at the same turn."""
    if turn == 0:
        return FIRST_QUESTIONS[chat % len(FIRST_QUESTIONS)]
    return FOLLOW_UPS[(turn - 1 + chat) % len(FOLLOW_UPS)]


def render_chat(messages: Sequence[dict[str, str]], chat_template: Any | None = None) -> str:
    """The prompt text of a conversation, ending where the assistant's next reply begins.

    Args:
        messages: [{'role': 'user' | 'assistant' | 'system', 'content': str}, ...].
        chat_template: a `kvlab.gguf_tokenizer.ChatTemplate` (SmolLM2's adds its default system
            prompt and ends with '<|im_start|>assistant\\n'); None for a model without one: a
            plain transcript, one 'Role: content' line per message (content stripped of
            surrounding whitespace), then 'Assistant:'.

    Raises:
        ValueError: a message without 'role' and 'content'.
    """
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
    """Play `num_chats` conversations of `num_turns` turns, all chats' turn t served together.

    At each turn every chat's history plus its new `question` is rendered (`render_chat`) and
    encoded; `serve_turn` gets the num_chats prompts (token ids) and returns the generated ids
    of each; each answer is decoded (without its end-of-sequence token) and appended to its chat's
    history as the assistant's message, which the next turn re-sends.

    Args:
        serve_turn: prompts -> answers, one per prompt, in order (e.g. an `LLMEngine` run).
        tokenizer: a `tokenizers.Tokenizer` (`encode(text).ids`, `decode(ids)`).
        chat_template: see `render_chat`.
        num_chats, num_turns: at least 1 each.
        eos_token_id: the stop token (or tokens: e.g. `ChatTemplate.stop_token_ids`) left out of
            the decoded reply (None: nothing left out).

    Returns:
        turns[turn][chat]: a `ChatTurn` for each turn of each chat.

    Raises:
        ValueError: num_chats or num_turns < 1, or serve_turn returned a number of answers other
            than the number of prompts.
    """
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
