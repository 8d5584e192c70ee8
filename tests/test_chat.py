"""Chat mode: the model's own chat template renders the prompt, its end-of-turn token ends the reply.

`kvlab.generate.chat` and `kvlab generate --chat` on small synthetic GGUF files (ChatML, as
SmolLM2's), and once on SmolLM2-135M-Instruct itself when it is fetched (skipped otherwise, except
in CI, as tests/test_smollm2.py). The reference for the prompt is the template rendered by hand;
for stopping, the same generation without a stop token, cut after the first stop token.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from cli_run import run
from gguf_synthetic import CHAT_TEMPLATE, write_llama_gguf
from kvlab.checkpoint import load_chat_template, load_model, load_tokenizer
from kvlab.fetch import model_available
from kvlab.generate import chat, generate
from kvlab.gguf_tokenizer import ChatTemplate, end_of_turn_token

QUESTION = "What is the capital of France?"
SHORT = "the cat"  # the synthetic vocabulary is mostly bytes: short, to fit its 64 positions
ENDOFTEXT, IM_START, IM_END = 0, 1, 2  # gguf_synthetic.CONTROL_TOKENS


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """(path, model, tokenizer) of a synthetic ChatML GGUF whose EOS is <|im_end|>."""
    path = tmp_path_factory.mktemp("chat") / "chatml.gguf"
    write_llama_gguf(path, seed=5)
    return path, load_model(path), load_tokenizer(path)


def test_the_stop_set_is_eos_and_the_templates_end_of_turn(tmp_path):
    """A ChatML fine-tune may keep <|endoftext|> as EOS: its replies still end at <|im_end|>."""
    write_llama_gguf(tmp_path / "a.gguf", eos_token_id=ENDOFTEXT)
    template = load_chat_template(tmp_path / "a.gguf")
    assert template.eos_token == "<|endoftext|>"
    assert template.stop_token_ids == {ENDOFTEXT, IM_END}
    write_llama_gguf(tmp_path / "b.gguf")  # EOS is <|im_end|> itself, as in SmolLM2-Instruct
    assert load_chat_template(tmp_path / "b.gguf").stop_token_ids == {IM_END}


def test_end_of_turn_token_is_read_off_the_template():
    control = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert end_of_turn_token(ChatTemplate(CHAT_TEMPLATE), control) == "<|im_end|>"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token(ChatTemplate(plain), control) is None  # no control token after it
    refusing = "{{ raise_exception('only one message') }}"
    assert end_of_turn_token(ChatTemplate(refusing), control) is None


def test_chat_renders_the_template_with_the_generation_prompt(gguf):
    path, model, tokenizer = gguf
    template = load_chat_template(path)
    result = chat(model, tokenizer, template, [SHORT], 4)
    expected = f"<|im_start|>user\n{SHORT}<|im_end|>\n<|im_start|>assistant\n"
    assert result.prompt_texts == [expected]
    assert result.prompt_ids == [tokenizer.encode(expected).ids]
    assert result.prompt_ids[0].count(IM_START) == 2  # control tokens are one token each
    system = chat(model, tokenizer, template, [SHORT], 4, system="Be brief.")
    assert system.prompt_texts == ["<|im_start|>system\nBe brief.<|im_end|>\n" + expected]


def test_chat_stops_at_the_end_of_turn_token_and_leaves_it_out_of_the_reply(gguf):
    path, model, tokenizer = gguf
    template = load_chat_template(path)
    prompt = tokenizer.encode(template.render([{"role": "user", "content": SHORT}])).ids
    free = generate(model, prompt, 8).token_ids  # no stop token: the reference
    # Make the third token the model generates this template's end-of-turn token.
    turn_ends = dataclasses.replace(template, stop_token_ids=frozenset({free[2]}))
    first = free.index(free[2])
    for cache in ("none", "contiguous", "paged", "prefix"):
        result = chat(model, tokenizer, turn_ends, [SHORT], 8, cache=cache)
        assert result.generation.token_ids == free[:first + 1], cache
        assert result.replies == [[tokenizer.decode(free[:first])]]


def test_several_messages_are_several_conversations_in_one_batch(gguf):
    path, model, tokenizer = gguf
    template = load_chat_template(path)
    questions = [SHORT, "Why is the sky blue?", SHORT]
    batch = chat(model, tokenizer, template, questions, 6)
    assert batch.generation.stats is not None  # the paged engine ran them together
    alone = [chat(model, tokenizer, template, [q], 6).replies[0] for q in questions]
    assert batch.replies == alone
    assert batch.replies[0] == batch.replies[2]


def test_a_model_without_a_template_chats_in_a_plain_transcript():
    tokenizer = load_tokenizer("tiny")
    result = chat(load_model("tiny"), tokenizer, None, ["Once upon a time"], 3)
    assert result.prompt_texts == ["User: Once upon a time\nAssistant:"]
    assert len(result.generation.token_ids) == 3  # no stop token: it runs to max_new_tokens


def test_chat_refuses_what_is_not_a_list_of_messages(gguf):
    path, model, tokenizer = gguf
    with pytest.raises(ValueError, match="one or more user messages"):
        chat(model, tokenizer, load_chat_template(path), [], 4)
    with pytest.raises(ValueError, match="one or more user messages"):
        chat(model, tokenizer, load_chat_template(path), SHORT, 4)  # a str, not a list


# ---- kvlab generate --chat -------------------------------------------------------------------

def test_cli_chat_prints_the_reply_alone_and_json_the_rendered_prompt(capsys, gguf):
    path = gguf[0]
    args = ["generate", "--model", str(path), "--chat", "--max-new-tokens", "5",
            "--prompt", SHORT]
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    [prompt] = data["prompts"]
    assert prompt["prompt_text"].endswith("<|im_start|>assistant\n")
    [completion] = prompt["completions"]
    reply = chat(gguf[1], gguf[2], load_chat_template(path), [SHORT], 5).replies[0][0]
    assert completion["text"] == reply
    code, out, err = run(capsys, *args)
    assert code == 0 and out == reply + "\n"  # no template text, no prompt: the reply alone
    code, out, err = run(capsys, *args, "--prompt", "Hi", "--system", "Be brief.", "--json")
    assert code == 0, err
    texts = [p["prompt_text"] for p in json.loads(out)["prompts"]]
    assert len(texts) == 2 and all(t.startswith("<|im_start|>system\nBe brief.") for t in texts)


@pytest.mark.parametrize("extra, named", [
    (["--model", "tiny", "--chat", "--prompt", "hi"],
     "--chat needs the model's chat template: tiny: no chat template"),
    (["--model", "tiny", "--system", "Be brief.", "--prompt", "hi"],
     "--system sets the system message of a chat; add --chat"),
    (["--model", "tiny", "--chat", "--prompt-ids", "1,2"], "--chat renders --prompt text"),
])
def test_cli_chat_refusals_are_one_line_exit_2(capsys, extra, named):
    code, out, err = run(capsys, "generate", "--max-new-tokens", "2", *extra)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"kvlab generate: error: {named}")


def test_cli_chat_refuses_a_gguf_without_a_template(capsys, tmp_path):
    write_llama_gguf(tmp_path / "plain.gguf", chat_template=None)
    code, out, err = run(capsys, "generate", "--model", str(tmp_path / "plain.gguf"), "--chat",
                         "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "no 'tokenizer.chat_template'" in err and "drop --chat" in err


# ---- SmolLM2-135M-Instruct -------------------------------------------------------------------

SMOLLM2 = "smollm2-135m"
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


@pytest.mark.skipif(not model_available(SMOLLM2) and not IN_CI,
                    reason=f"{SMOLLM2} not downloaded: run `kvlab fetch {SMOLLM2}` (98 MB)")
def test_smollm2_answers_the_france_question_and_stops_at_im_end(capsys):
    code, out, err = run(capsys, "generate", "--model", SMOLLM2, "--chat", "--prompt", QUESTION,
                         "--max-new-tokens", "32", "--json")
    assert code == 0, err
    [completion] = json.loads(out)["prompts"][0]["completions"]
    assert completion["text"] == "The capital of France is Paris."
    # Stopped by its end-of-turn token (<|im_end|>, id 2), not by max_new_tokens.
    assert completion["token_ids"][-1] == 2 and len(completion["token_ids"]) < 32
