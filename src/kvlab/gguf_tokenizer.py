"""The tokenizer and chat template stored in a GGUF file's metadata.

There is no tokenizer.json; llama.cpp's converter stores the pieces: `tokenizer.ggml.model` ("gpt2"
= byte-level BPE), `.tokens` (id = list index), `.merges` ("a b", best first), `.token_type` (3 =
control token such as `<|im_start|>`), `.pre` (the pre-tokenizer) and `tokenizer.chat_template`
(Jinja, as in HF's tokenizer_config.json), assembled here with `tokenizers` and sandboxed `jinja2`
as `apply_chat_template` does (tests/test_gguf_loader.py compares both with transformers' own). A
reply ends at the end-of-turn token, which need not be EOS: a ChatML fine-tune may keep
`<|endoftext|>` as EOS while its template closes messages with `<|im_end|>`. llama.cpp stops at EOS,
EOT, EOM and known end-of-turn texts (llama-vocab.cpp); kvlab reads the control token the template
writes right after a message's content (`ChatTemplate.stop_token_ids`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .config import ConfigError
from .gguf_loader import open_gguf, gguf_metadata

__all__ = ["load_gguf_tokenizer", "ChatTemplate", "load_chat_template", "end_of_turn_token",
           "special_token_ids"]

_CONTROL = 3  # llama.cpp's token type for control tokens (<|endoftext|>, <|im_start|>, ...)

# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) whose split kvlab reproduces. SmolLM2
# ("smollm") shares StarCoder's: every digit is its own piece, then GPT-2's byte-level regex
# (llama.cpp llama-vocab.cpp groups LLAMA_VOCAB_PRE_TYPE_SMOLLM with STARCODER for that reason).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_PRE = ("gpt2", "default")


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre is None or pre in _GPT2_PRE:
        return byte_level
    raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not one kvlab reproduces "
                      f"({', '.join(_DIGIT_SPLIT_PRE + _GPT2_PRE)}); pass token ids instead")


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Byte-level BPE with control tokens as special tokens (`<|im_start|>` is one token; decode
    skips them). FileNotFoundError; ConfigError: not "gpt2", or a pre-tokenizer not reproduced."""
    reader = open_gguf(path)
    kind = gguf_metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"{path}: tokenizer type {kind!r} is not byte-level BPE ('gpt2'), "
                          f"the only kind kvlab builds from GGUF metadata")
    tokens: list[str] = gguf_metadata(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1))
              for merge in gguf_metadata(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)},
                                     merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(gguf_metadata(reader, "tokenizer.ggml.pre", None))
    tokenizer.decoder = decoders.ByteLevel()
    types = gguf_metadata(reader, "tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind_ in zip(tokens, types) if kind_ == _CONTROL])
    return tokenizer


def special_token_ids(path: str | Path) -> dict[str, int | None]:
    """{'bos_token_id', 'eos_token_id', 'unk_token_id', 'pad_token_id'} from the metadata (None
    when absent). For SmolLM2-Instruct eos is `<|im_end|>` (id 2): the end of an assistant turn."""
    reader = open_gguf(path)
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "unk_token_id": "unknown",
            "pad_token_id": "padding"}
    return {name: gguf_metadata(reader, f"tokenizer.ggml.{key}_token_id", None)
            for name, key in keys.items()}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Messages [{'role': ..., 'content': ...}] -> prompt text; generation stops at any of
    stop_token_ids (EOS, EOT/EOM and the template's end-of-turn token)."""

    template: str
    bos_token: str = ""
    eos_token: str = ""
    stop_token_ids: frozenset[int] = frozenset()

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt, ending where the reply begins with add_generation_prompt (SmolLM2:
        '<|im_start|>assistant\\n'). ValueError: no 'role'/'content', or the template raised."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        for index, message in enumerate(messages):
            if not {"role", "content"} <= set(message):
                raise ValueError(f"message {index} needs 'role' and 'content', "
                                 f"got {sorted(message)}")

        def raise_exception(text: str) -> None:
            raise TemplateError(text)

        # The environment transformers' apply_chat_template uses (trim_blocks, lstrip_blocks).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as error:
            raise ValueError(f"chat template: {error}") from error


def load_chat_template(path: str | Path) -> ChatTemplate:
    """The file's template; FileNotFoundError: no file; ConfigError: no tokenizer.chat_template."""
    reader = open_gguf(path)
    tokens = gguf_metadata(reader, "tokenizer.ggml.tokens")

    def token_id(key: str) -> int | None:
        return gguf_metadata(reader, f"tokenizer.ggml.{key}_token_id", None)

    def token(key: str) -> str:
        return tokens[token_id(key)] if token_id(key) is not None else ""

    template = ChatTemplate(gguf_metadata(reader, "tokenizer.chat_template"),
                            bos_token=token("bos"), eos_token=token("eos"))
    types = gguf_metadata(reader, "tokenizer.ggml.token_type", [])
    control = {tokens[i]: i for i, kind in enumerate(types) if kind == _CONTROL}
    stops = {token_id(key) for key in ("eos", "eot", "eom")} - {None}
    end_of_turn = end_of_turn_token(template, control)
    if end_of_turn is not None:
        stops.add(control[end_of_turn])
    return dataclasses.replace(template, stop_token_ids=frozenset(stops))


_SENTINEL = "kvlab-reply-ends-here"


def end_of_turn_token(template: ChatTemplate, control_tokens: dict[str, int]) -> str | None:
    """The control token written right after an assistant message (SmolLM2: '<|im_end|>'), else
    None (also if no user/assistant exchange renders). control_tokens: text -> id; longest wins."""
    try:
        text = template.render([{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": _SENTINEL}],
                               add_generation_prompt=False)
    except ValueError:
        return None
    after = text.rpartition(_SENTINEL)[2] if _SENTINEL in text else ""
    matches = [token for token in control_tokens if token and after.startswith(token)]
    return max(matches, key=len, default=None)
