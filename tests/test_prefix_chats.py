"""kvlab.prefix.chats: multi-turn chats rendered as text, each turn re-sending the conversation.

The loop is checked with a scripted server (exact prompts and histories), then through the real
engine with the tiny model: prefix caching on gives the same tokens as off, and turn 2's hits are
exactly the full blocks it shares with what turn 1 fed the model (prompt and answer)."""

from __future__ import annotations

import pytest

from kvlab.checkpoint import load_model, load_tokenizer
from kvlab.gguf_tokenizer import ChatTemplate
from kvlab.prefix.chats import FIRST_QUESTIONS, FOLLOW_UPS, question, render_chat, run_chats
from kvlab.serving import LLMEngine, generate_batch

# ChatML as SmolLM2 writes it, shortened: a default system prompt when the chat brings none.
CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def test_questions_rotate_so_chats_differ_at_each_turn():
    assert [question(chat, 0) for chat in range(3)] == list(FIRST_QUESTIONS[:3])
    for turn in range(1, 4):
        asked = [question(chat, turn) for chat in range(len(FOLLOW_UPS))]
        assert sorted(asked) == sorted(FOLLOW_UPS)  # every follow-up once: no two chats alike


def test_render_chat_plain_transcript_and_template():
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": " Hello.\n"},
                {"role": "user", "content": "Why?"}]
    assert render_chat(messages) == "User: Hi?\nAssistant: Hello.\nUser: Why?\nAssistant:"
    assert render_chat(messages, ChatTemplate(CHATML)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n Hello.\n<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="message 1 needs 'role' and 'content'"):
        render_chat([{"role": "user", "content": "a"}, {"content": "b"}])


@pytest.mark.parametrize("template", [None, ChatTemplate(CHATML)], ids=["plain", "chatml"])
def test_each_turn_resends_the_conversation_with_the_answers(tokenizer, template):
    served = []

    def scripted(prompts):  # answer k of call c: the text "reply c k", then token 0 as "eos"
        served.append(prompts)
        return [tokenizer.encode(f"reply {len(served)} {k}").ids + [0]
                for k in range(len(prompts))]

    turns = run_chats(scripted, tokenizer, template, num_chats=2, num_turns=3, eos_token_id=0)
    assert [len(this_turn) for this_turn in turns] == [2, 2, 2]
    assert served == [[chat_turn.prompt_ids for chat_turn in this_turn] for this_turn in turns]
    for turn, this_turn in enumerate(turns):
        for chat, chat_turn in enumerate(this_turn):
            assert (chat_turn.chat, chat_turn.turn) == (chat, turn)
            assert chat_turn.question == question(chat, turn)
            assert chat_turn.prompt_ids == tokenizer.encode(chat_turn.prompt_text).ids
            assert chat_turn.answer_ids[-1] == 0  # the eos token is kept in the ids ...
            assert chat_turn.reply == tokenizer.decode(chat_turn.answer_ids[:-1])  # ... not here
            assert chat_turn.reply.strip() == f"reply {turn + 1} {chat}"
            if turn:  # the previous turn's text, its reply, then the new question
                before = turns[turn - 1][chat]
                resent = (before.prompt_text + " " + before.reply.strip() + "\n" if template is None
                          else before.prompt_text + before.reply + "<|im_end|>\n")
                assert chat_turn.prompt_text.startswith(resent)
                assert chat_turn.question in chat_turn.prompt_text[len(resent):]


def test_bad_arguments_are_refused(tokenizer):
    with pytest.raises(ValueError, match="num_chats must be a positive integer, got 0"):
        run_chats(lambda prompts: prompts, tokenizer, num_chats=0)
    with pytest.raises(ValueError, match="returned 1 answers for 2 prompts"):
        run_chats(lambda prompts: [[1]], tokenizer, num_chats=2)


def shared_run(fed: list[int], prompt: list[int]) -> int:
    """Length of the common start of two token lists."""
    shared = 0
    while shared < min(len(fed), len(prompt)) and fed[shared] == prompt[shared]:
        shared += 1
    return shared


def test_engine_with_prefix_cache_equals_no_cache_and_turn_2_hits_turn_1(tokenizer):
    model, block_size, new = load_model("tiny"), 16, 24
    engine = LLMEngine(model, num_blocks=128, block_size=block_size, max_model_len=512,
                       enable_prefix_caching=True)
    hits_per_turn = []

    def serve(prompts):
        before = engine.prefix_stats.num_hit_tokens
        request_ids = [engine.add_request(prompt, new) for prompt in prompts]
        engine.run()
        hits_per_turn.append(engine.prefix_stats.num_hit_tokens - before)
        return [engine.outputs(request_id)[0] for request_id in request_ids]

    turns = run_chats(serve, tokenizer, None, num_chats=2, num_turns=2)
    prompts = [chat_turn.prompt_ids for this_turn in turns for chat_turn in this_turn]
    answers = [chat_turn.answer_ids for this_turn in turns for chat_turn in this_turn]
    assert generate_batch(model, prompts, new, block_size=block_size).token_ids == answers
    assert hits_per_turn[0] == 0  # "User: What ..." and "User: How ...": no full block in common
    expected = 0
    for first, second in zip(turns[0], turns[1]):
        # K/V was written for the prompt and every answer token but the last (never fed back).
        shared = shared_run(first.prompt_ids + first.answer_ids[:-1], second.prompt_ids)
        assert shared >= len(first.prompt_ids) - 1  # at least the whole first prompt but ':'
        expected += min(shared, len(second.prompt_ids) - 1) // block_size * block_size
    assert hits_per_turn[1] == expected > 0
