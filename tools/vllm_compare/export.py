"""The model as vLLM loads it: a Hugging Face folder written from kvlab's own weights.

vLLM reads a folder with `config.json` and `*.safetensors`. kvlab's SmolLM2 is a 4-bit GGUF file;
`kvlab.checkpoint.load_model` dequantizes it to floats, and `save_model` writes those floats in
the HF layout, so both engines run the very same fp32 weights (a GGUF loaded by vLLM itself would
go through its own dequantization). The tokenizer is not written: the comparison sends token ids
and reads token ids (vLLM's `skip_tokenizer_init=True`).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["export_hf_folder", "MARKER"]

# What was exported, from which file: a folder is reused only while this matches.
MARKER = "kvlab_export.json"


def export_hf_folder(model_name: str, folder: str | Path, eos_token_id: int | None = None,
                     bos_token_id: int | None = None) -> Path:
    """Write `model_name` ('smollm2-135m', 'tiny', a GGUF path ...) as an fp32 HF folder; reuse the
    folder when it already holds this export. Returns the folder.

    Adds what `save_model` leaves out and vLLM reads: bos/eos ids in config.json and a
    generation_config.json.
    """
    import torch

    from kvlab.checkpoint import gguf_file, load_model, save_model

    folder = Path(folder)
    source = gguf_file(model_name)
    stamp = {"model": str(model_name), "dtype": "float32",
             "source": None if source is None else str(source),
             "source_bytes": None if source is None else source.stat().st_size}
    marker = folder / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return folder
    model = load_model(model_name, dtype=torch.float32)
    save_model(model, folder, torch.float32)
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    marker.write_text(json.dumps(stamp) + "\n")
    return folder
