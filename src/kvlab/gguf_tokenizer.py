"""The tokenizer and chat template stored in a GGUF file's metadata.

A GGUF file carries no tokenizer.json; llama.cpp's converter stores the pieces instead:
`tokenizer.ggml.model` ("gpt2" = byte-level BPE), `tokenizer.ggml.tokens` (the vocabulary, id = list
index), `tokenizer.ggml.merges` ("a b" strings, best first), `tokenizer.ggml.token_type` (3 marks a
control token such as `<|im_start|>`), `tokenizer.ggml.pre` (which pre-tokenizer split the text
before BPE) and `tokenizer.chat_template` (a Jinja template, as in HF's tokenizer_config.json).

kvlab assembles these with the `tokenizers` library (the one behind every HF fast tokenizer) and
renders the chat template with `jinja2` in a sandbox, as transformers' `apply_chat_template` does.
tests/test_gguf_model.py checks both against transformers' own GGUF tokenizer conversion.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .config import ConfigError
from .gguf_loader import open_gguf, gguf_metadata

__all__ = ["load_gguf_tokenizer", "ChatTemplate", "load_chat_template", "special_token_ids"]

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
    """A `tokenizers.Tokenizer` built from the GGUF's byte-level BPE vocabulary and merges.

    Control tokens (token_type 3) are registered as special tokens, so `<|im_start|>` in a chat
    prompt is one token, and `decode` leaves them out by default (skip_special_tokens=True).

    Raises:
        FileNotFoundError: no file. ConfigError: not byte-level BPE ("gpt2"), or a pre-tokenizer
            kvlab does not reproduce (the name is in the message).
    """
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
    """A model's chat template: messages [{'role': ..., 'content': ...}] -> the prompt text.

    template: the Jinja source from `tokenizer.chat_template`; bos_token / eos_token: the strings
    the template may refer to.
    """

    template: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation; with add_generation_prompt it ends where the
        assistant's reply begins (for SmolLM2: '<|im_start|>assistant\\n').

        Raises:
            ValueError: a message without 'role' and 'content', or the template raised an error.
        """
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
    """The `ChatTemplate` stored in a GGUF file.

    Raises:
        FileNotFoundError: no file. ConfigError: the file has no tokenizer.chat_template.
    """
    reader = open_gguf(path)
    tokens = gguf_metadata(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str:
        index = gguf_metadata(reader, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[index] if index is not None else ""

    return ChatTemplate(gguf_metadata(reader, "tokenizer.chat_template"),
                        bos_token=token("bos"), eos_token=token("eos"))
