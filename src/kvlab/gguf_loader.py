"""Load a Llama-architecture GGUF file (llama.cpp's format) into kvlab's decoder.

A GGUF file holds metadata (the shape under llama.cpp's key names, the tokenizer) and tensors,
usually quantized (Q4_1: each block of 32 weights as 4-bit integers plus an fp16 scale and an fp16
minimum). The `gguf` library (from the llama.cpp repository) parses the file and dequantizes every
type to float32; this module only translates: metadata -> `LlamaConfig` with HF field names
(`llama.attention.head_count_kv` -> `num_key_value_heads`), tensor names -> HF parameter names
(`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), and the q/k row order:
llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`) interleaves the channel pairs
RoPE rotates together, where HF's "rotate half" pairs i with i + head_dim/2 (`unpermute_rows`).
The weights are the 4-bit-rounded ones: logits differ from the bf16 release and equal
transformers' own dequantized load of the file (tests/test_gguf_loader.py, to 1e-4).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError, LlamaConfig
from .device import default_dtype, resolve_device
from .model import LlamaForCausalLM

__all__ = ["open_gguf", "read_gguf_config", "gguf_metadata", "gguf_tensor_name_to_hf",
           "unpermute_rows", "load_gguf_state_dict", "load_gguf_model", "describe_quantization"]

_REQUIRED = object()

# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED_TENSORS = ("rope_freqs.weight",)


def open_gguf(path: str | Path):
    """A memory-mapped `gguf.GGUFReader`, one per (path, size, mtime) as a parse takes seconds: read
    only, shared by model, tokenizer and chat template. FileNotFoundError; ConfigError: not GGUF."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = path.stat()
    return _cached_reader(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: Path, size: int, mtime_ns: int):
    import gguf  # imported here so `import kvlab` stays light

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as error:  # wrong magic, truncated file
        raise ConfigError(f"{path}: not a readable GGUF file ({error})") from error


def gguf_metadata(reader: Any, key: str, default: Any = _REQUIRED) -> Any:
    """One metadata value as a Python object; ConfigError if absent and no default is given."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ConfigError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def read_gguf_config(path_or_reader: Any, name: str | None = None) -> LlamaConfig:
    """The model's shape: head_dim is `{arch}.attention.key_length` or embedding_length/head_count;
    tied without `output.weight`. FileNotFoundError; ConfigError: not GGUF, not llama, a missing key
    (RoPE scaling is kept for `check_model_supported` to name)."""
    reader = path_or_reader if hasattr(path_or_reader, "fields") else open_gguf(path_or_reader)
    arch = gguf_metadata(reader, "general.architecture")
    label = name or gguf_metadata(reader, "general.name", "gguf")
    if arch != "llama":
        raise ConfigError(f"{label}: GGUF architecture {arch!r} is not a Llama-style decoder "
                          f"kvlab implements (llama)")

    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return gguf_metadata(reader, f"{arch}.{suffix}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    head_dim = key("attention.key_length", None) or hidden // heads
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab = key("vocab_size", None) or len(gguf_metadata(reader, "tokenizer.ggml.tokens"))
    scaling = key("rope.scaling.type", "none")
    rope_scaling = None if scaling in ("none", None) else {
        "rope_type": scaling, "factor": key("rope.scaling.factor", 1.0)}
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        name=label,
    )


def gguf_tensor_name_to_hf(name: str) -> str | None:
    """The HF name; None for tensors the decoder recomputes (rope_freqs); KeyError: unknown."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _IGNORED_TENSORS:
        return None
    prefix, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    raise KeyError(f"GGUF tensor {name!r} has no counterpart in a Llama decoder")


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[num_heads * head_dim, hidden_size] with each head's rows from interleaved (0, d/2, 1,
    d/2 + 1, ...) to rotate-half order; num_heads is q's or k's. ValueError: head_dim not even."""
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even head_dim")
    half = rows // num_heads // 2
    # Stored: per head, pairs (first-half channel i, second-half channel i) for i < half.
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def describe_quantization(path: str | Path) -> dict[str, int]:
    """Tensors per GGUF type; SmolLM2-135M-Instruct.Q4_1: {'Q8_0': 1, 'F32': 61, 'Q4_1': 210}."""
    counts: dict[str, int] = {}
    for tensor in open_gguf(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def load_gguf_state_dict(path: str | Path, dtype: torch.dtype = torch.float32
                         ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(config, {HF name: CPU tensor in dtype}), q/k rows in HF order, no lm_head.weight when tied.
    Raises as `read_gguf_config`; KeyError: an unknown tensor; ValueError: an unexpected shape."""
    import gguf

    reader = open_gguf(path)
    config = read_gguf_config(reader, name=Path(path).stem)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    expected_shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_tensor_name_to_hf(tensor.name)
        if hf_name is None:
            continue
        # gguf returns float32 in numpy order: [rows, columns] = the file's dims reversed. F32
        # tensors come back as read-only views of the memory-mapped file: copy those.
        array = gguf.dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C", copy=True)
        values = torch.from_numpy(array)
        if tuple(values.shape) != expected_shapes[hf_name]:
            raise ValueError(f"{tensor.name} has shape {tuple(values.shape)}, but {hf_name} needs "
                             f"{expected_shapes[hf_name]} for this config")
        if hf_name.endswith("q_proj.weight"):
            values = unpermute_rows(values, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            values = unpermute_rows(values, config.num_key_value_heads)
        tensors[hf_name] = values.to(dtype)
    return config, tensors


def load_gguf_model(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None) -> LlamaForCausalLM:
    """The decoder with the file's dequantized weights (float32 keeps them exactly). Raises as
    `load_gguf_state_dict`; KeyError: a parameter missing from the file (names listed)."""
    device = resolve_device(device)
    config, tensors = load_gguf_state_dict(path, dtype if dtype is not None
                                           else default_dtype(device))
    with torch.device("meta"):  # no random init: every parameter is assigned from the file below
        model = LlamaForCausalLM(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise KeyError(f"{path}: GGUF file lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()
