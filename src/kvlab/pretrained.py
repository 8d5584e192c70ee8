"""One call for notebooks and servers: the real pretrained model if fetched, else the tiny model.

Nothing is downloaded here: when the file is missing, the tiny model is loaded and `note` gives the
fetch command. SmolLM2's weights are 4-bit (Q4_1) dequantized to floats.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .checkpoint import eos_token_id, load_chat_template, load_model, load_tokenizer
from .fetch import PRETRAINED, model_available
from .model import LlamaForCausalLM

__all__ = ["LoadedModel", "load_course_model"]


@dataclasses.dataclass
class LoadedModel:
    """name 'smollm2-135m' or 'tiny' (no chat template, no EOS); load_seconds varies run to run
    (print it only in cells nbval does not compare); note: one line saying what was loaded."""

    name: str
    model: LlamaForCausalLM
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: Any | None
    eos_token_id: int | None
    load_seconds: float
    note: str

    @property
    def is_pretrained(self) -> bool:
        return self.name != "tiny"

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The chat template's stop ids, else EOS alone, else none (the tiny model)."""
        if self.chat_template is not None:
            return self.chat_template.stop_token_ids
        return frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})


def load_course_model(name: str = "smollm2-135m", dtype: torch.dtype | None = None,
                      device: str | torch.device | None = None, fallback: str = "tiny"
                      ) -> LoadedModel:
    """`name` if `kvlab fetch name` was run, else `fallback`; ValueError: not in `PRETRAINED`."""
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; choose from {', '.join(PRETRAINED)}")
    start = time.perf_counter()
    if model_available(name):
        model = load_model(name, dtype=dtype, device=device)
        note = (f"loaded {name} ({PRETRAINED[name].description})")
        return LoadedModel(name, model, load_tokenizer(name), load_chat_template(name),
                           eos_token_id(name), time.perf_counter() - start, note)
    model = load_model(fallback, dtype=dtype, device=device)
    note = (f"{name} is not downloaded, so this uses the {fallback} model instead; run "
            f"`kvlab fetch {name}` (98 MB) and re-run to see a real pretrained model")
    return LoadedModel(fallback, model, load_tokenizer(fallback), None, None,
                       time.perf_counter() - start, note)
