"""Model configuration with Hugging Face Llama field names.

A `LlamaConfig` holds the numbers that size a model's weights and KV cache, named as in a Hugging
Face `config.json`, so any published checkpoint's config reads against it, in either RoPE style:
top-level `rope_theta` + `rope_scaling` (Llama 2/3, Mistral, Qwen2) or the `rope_parameters` dict
of current `transformers`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

__all__ = ["LlamaConfig", "ConfigError", "PRESETS", "COURSE_MODELS", "load_config"]

# The course's own models, committed with kvlab (weights and all), so `--model tiny` works for every
# subcommand (`kvlab size tiny` reads the folder's config.json).
COURSE_MODELS = {name: Path(__file__).parent / "models" / name for name in ("tiny", "tiny-mha")}


class ConfigError(ValueError):
    """A configuration that cannot describe a working model (the message names the bad value)."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style decoder, every size a count, never bytes. ConfigError: a size
    <= 0, or KV heads not each serving a whole group of query heads (Ainslie et al. 2023, 2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim",
                      "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{self.name}: num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; each KV head must serve a whole "
                f"group of query heads")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head: 1 for MHA, num_attention_heads for MQA."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_type(self) -> str:
        """'default' for plain RoPE, else the scaling kind ('llama3', 'linear', 'yarn', ...)."""
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def with_changes(self, **changes: Any) -> "LlamaConfig":
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict, name: str = "custom") -> "LlamaConfig":
        """From a HF `config.json` dict. An explicit `head_dim` wins (Mistral Nemo's differs from
        hidden_size / num_attention_heads); a missing num_key_value_heads means MHA. ConfigError:
        a required field missing, or head_dim underivable."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [key for key in required if key not in raw]
        if missing:
            raise ConfigError(f"{name}: config is missing {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if raw["hidden_size"] % heads:
                raise ConfigError(
                    f"{name}: no head_dim given and hidden_size={raw['hidden_size']} is not "
                    f"divisible by num_attention_heads={heads}")
            head_dim = raw["hidden_size"] // heads

        rope_parameters = raw.get("rope_parameters")
        if rope_parameters:
            rope_theta = rope_parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
            kind = rope_parameters.get("rope_type", "default")
            rope_scaling = None if kind == "default" else dict(rope_parameters)
        else:
            rope_theta = raw.get("rope_theta", 10000.0)
            rope_scaling = raw.get("rope_scaling")

        model_type = raw.get("model_type", "llama")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            # An absent (or null) num_key_value_heads means MHA; an explicit 0 is an error below.
            num_key_value_heads=heads if raw.get("num_key_value_heads") is None
            else raw["num_key_value_heads"],
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and writes no attention_bias field.
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            name=name,
        )

    def to_hf_dict(self) -> dict:
        """The config as a Hugging Face `LlamaConfig` dict (what `save_pretrained` writes)."""
        raw = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
        }
        return raw


def _preset(name: str, **fields: Any) -> LlamaConfig:
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    return LlamaConfig(name=name, **fields)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Shapes copied from each model's published config.json (numbers are facts, not code).
PRESETS: dict[str, LlamaConfig] = {
    config.name: config for config in [
        _preset("llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
        _preset("llama-3.1-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
        _preset("llama-3.1-405b", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
        _preset("llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
        _preset("llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                max_position_embeddings=4096),
        _preset("mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=32768, model_type="mistral"),
        _preset("qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                attention_bias=True, model_type="qwen2"),
        _preset("tinyllama-1.1b", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                max_position_embeddings=2048),
        _preset("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    ]
}


def load_config(model: str | Path) -> LlamaConfig:
    """A preset, a course model ('tiny', 'tiny-mha'), a `config.json` or its folder. ConfigError:
    none of those, not a JSON object, a bad field; InputFileError: as `read_text`."""
    from .input_files import read_text

    key = str(model).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(model)
    if key in COURSE_MODELS and not path.exists():  # a folder named `tiny` here still wins
        path = COURSE_MODELS[key]
    expected = "a Hugging Face config.json (a JSON object with hidden_size, num_attention_heads, ...)"
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"{path}: this folder has no config.json; expected {expected}")
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(
            f"unknown model {str(model)!r}: not a preset ({', '.join(sorted(PRESETS))}), not a "
            f"course model ({', '.join(COURSE_MODELS)}) and no config.json at {path}")
    text = read_text(path, expected)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error}); expected {expected}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: holds a JSON {type(raw).__name__}; expected {expected}")
    name = path.parent.name or str(path)
    try:
        return LlamaConfig.from_hf_dict(raw, name=name)
    except (TypeError, ValueError, AttributeError) as error:
        if isinstance(error, ConfigError):
            raise
        # e.g. "hidden_size": "4096" (a string) or "rope_parameters": 5
        raise ConfigError(f"{path}: a field has the wrong type ({error}); expected {expected}") \
            from None
