"""Load and save Llama checkpoints in the Hugging Face folder layout.

`config.json`, `*.safetensors` (HF parameter names) and `tokenizer.json`, as `save_pretrained`
writes, the Hub serves and the tiny model (`TINY_MODEL_DIR`) has. A GGUF file loads too, by path
or fetched with `kvlab fetch` (`kvlab.fetch`, `kvlab.gguf_loader`, `kvlab.gguf_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from .config import COURSE_MODELS, PRESETS, ConfigError, LlamaConfig, load_config
from .device import default_dtype, resolve_device
from .fetch import PRETRAINED, model_path
from .input_files import MissingInputFileError, input_file_error, read_text
from .model import LlamaForCausalLM

__all__ = ["TINY_MODEL_DIR", "TINY_MHA_MODEL_DIR", "resolve_model_dir", "gguf_file",
           "load_model", "load_tokenizer", "load_chat_template", "eos_token_id", "save_model"]

MODELS_DIR = COURSE_MODELS["tiny"].parent
TINY_MODEL_DIR = MODELS_DIR / "tiny"
TINY_MHA_MODEL_DIR = MODELS_DIR / "tiny-mha"
_NAMED_MODELS = {"tiny": TINY_MODEL_DIR, "tiny-mha": TINY_MHA_MODEL_DIR}

# Buffers that some older checkpoints saved; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_CHECKPOINT = "a checkpoint folder with config.json, *.safetensors and tokenizer.json"
# Every other form --model takes, so a typo's message shows the whole menu.
_OTHER_MODELS = (f"or --model tiny, tiny-mha, {', '.join(PRETRAINED)} after `kvlab fetch "
                 f"{next(iter(PRETRAINED))}`, or a *.gguf file")


def resolve_model_dir(model: str | Path) -> Path:
    """'tiny', 'tiny-mha' or a checkpoint folder path -> the folder. ConfigError: a size preset
    (shapes, no weights); MissingInputFileError: no folder or config.json; InputFileError: a file."""
    if str(model) in _NAMED_MODELS:
        return _NAMED_MODELS[str(model)]
    folder = Path(model)
    if not folder.exists() and str(model).lower() in PRESETS:
        raise ConfigError(f"{model!r} is a size preset (the shape of a model, no weights): presets "
                          f"are for `kvlab size` and `kvlab report --model`; to generate, use "
                          f"--model tiny, tiny-mha, {', '.join(PRETRAINED)} (after `kvlab fetch`), "
                          f"a *.gguf file or {_CHECKPOINT}")
    if not folder.exists():
        raise MissingInputFileError(f"{folder}: no such folder; expected {_CHECKPOINT} "
                                    f"({_OTHER_MODELS})")
    if not folder.is_dir():
        raise input_file_error(folder, "is a file, not a folder", _CHECKPOINT)
    if not (folder / "config.json").is_file():
        raise MissingInputFileError(f"{folder}: no config.json in this folder; expected "
                                    f"{_CHECKPOINT} ({_OTHER_MODELS})")
    return folder


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file of a fetched model ('smollm2-135m') or a `*.gguf` path, else None.
    ModelNotFetchedError (names `kvlab fetch <name>`); FileNotFoundError: no such *.gguf."""
    if str(model) in PRETRAINED:
        return model_path(str(model))
    if str(model).endswith(".gguf"):
        if not Path(model).is_file():
            raise MissingInputFileError(f"{model}: no such GGUF file")
        return Path(model)
    return None


def load_model(model: str | Path = "tiny", dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> LlamaForCausalLM:
    """'tiny', 'tiny-mha', a checkpoint folder, a fetched model or a `*.gguf` file, loaded on
    `device` in `dtype` (defaults: the course's, `kvlab.device`). FileNotFoundError: no config.json or *.safetensors, or not fetched; InputFileError: an
    unreadable file; ConfigError: unsupported; KeyError: weights missing or unexpected (listed)."""
    device = resolve_device(device)
    dtype = dtype if dtype is not None else default_dtype(device)
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        from .gguf_loader import load_gguf_model

        return load_gguf_model(gguf_path, dtype=dtype, device=device)
    folder = resolve_model_dir(model)
    config = load_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MissingInputFileError(f"{folder}: no *.safetensors files in this folder; expected "
                                    f"{_CHECKPOINT}")
    # The model is built once, for real: a meta-device skeleton to learn the names first would
    # pull in torch._dynamo (meta init goes through torch._refs), ~2 s of every CLI start-up.
    model_ = LlamaForCausalLM(config)
    expected = set(model_.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        tensors[name] = handle.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as error:  # truncated, not safetensors, unreadable
            raise input_file_error(file, f"cannot be read as safetensors ({error})",
                                   "a safetensors file of the checkpoint's weights") from None
    missing, unexpected = expected - set(tensors), set(tensors) - expected - {"lm_head.weight"}
    if missing or unexpected:
        raise KeyError(f"{folder}: checkpoint does not match the config; missing "
                       f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")

    model_ = model_.to(dtype)
    model_.load_state_dict(tensors, strict=False)
    if config.tie_word_embeddings:
        model_.lm_head.weight = model_.model.embed_tokens.weight
    return model_.to(device).eval()


def load_tokenizer(model: str | Path = "tiny") -> Tokenizer:
    """The folder's tokenizer.json, or a GGUF file's. FileNotFoundError: none, or not fetched;
    InputFileError: tokenizer.json is not a `tokenizers` tokenizer."""
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        from .gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf_path)
    path = resolve_model_dir(model) / "tokenizer.json"
    if not path.is_file():
        raise MissingInputFileError(f"no tokenizer.json in {path.parent}; pass --prompt-ids instead")
    expected = "a Hugging Face `tokenizers` tokenizer.json"
    text = read_text(path, expected)
    try:
        return Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception for any malformed file
        raise input_file_error(path, f"cannot be read as a tokenizer ({str(error)[:120]})",
                               expected) from None


def load_chat_template(model: str | Path = "smollm2-135m"):
    """A GGUF model's `ChatTemplate`; ValueError for the tiny model; else raises as `gguf_file`."""
    gguf_path = gguf_file(model)
    if gguf_path is None:
        raise ValueError(f"{model}: no chat template (only GGUF models such as smollm2-135m "
                         f"carry one)")
    from .gguf_tokenizer import load_chat_template as from_gguf

    return from_gguf(gguf_path)


def eos_token_id(model: str | Path) -> int | None:
    """The token that ends a reply (SmolLM2-Instruct: `<|im_end|>`, id 2); None for the tiny model."""
    gguf_path = gguf_file(model)
    if gguf_path is None:
        return None
    from .gguf_tokenizer import special_token_ids

    return special_token_ids(gguf_path)["eos_token_id"]


def save_model(model: LlamaForCausalLM, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json and model.safetensors (HF layout; a tied lm_head is not stored)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(dtype or tensor.dtype).contiguous().cpu()
             for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    raw = model.config.to_hf_dict()
    raw["torch_dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
