"""Shared fixtures: tiny random Hugging Face Llama checkpoints and config.json writers.

The HF checkpoints are the independent reference for the decoder: `transformers.LlamaForCausalLM`
with random (not trained) weights, saved with `save_pretrained` to a temporary folder, so a test can
load the same folder with `kvlab.checkpoint.load_model` and compare logits and greedy tokens.

Fixtures (session-scoped, built once and only when a test asks for them):

* `make_hf_checkpoint(**llama_config_overrides)` -> HFCheckpoint: any tiny variant, cached by its
  overrides.
* `hf_checkpoint`: GQA, vocab 128, hidden 64, 2 layers, 8 query heads, 2 KV heads (group of 4).
* `hf_tied_checkpoint`: the same with tie_word_embeddings=True.
* `hf_head_dim_checkpoint`: explicit head_dim=12, unlike hidden_size / heads = 8.
* `tiny_model`: `kvlab` model loaded from `hf_checkpoint` (eval mode; do not modify it).
* `small_config`, `small_llama`: a kvlab decoder with no checkpoint behind it (vocab 64, hidden 32,
  2 layers, 4 query / 2 KV heads, head_dim 8, 128 positions; random weights, seed 0; read-only),
  for the cache, engine and sampling tests.

Function-scoped: `write_config(folder, **fields)` writes a small config.json and returns its path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

# First, before torch: a folder of the repository that shadows an installed package (a `numpy/`
# at the root, say) stops the suite here with its name, not with a traceback from inside torch.
from import_shadowing import check_start_folders

check_start_folders()

import pytest  # noqa: E402
import torch  # noqa: E402

# Every tensor in these tests is tiny: an intra-op thread pool only adds synchronisation, and on a
# busy 2-core CI machine it made the suite several times slower. An explicit OMP_NUM_THREADS wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# Without a GPU, the stage-5 Triton kernels run in Triton's CPU interpreter; triton.jit reads this
# when a kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped on machines without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_on_cpu():
    """For a test that runs the Triton kernels on CPU tensors, i.e. in Triton's interpreter.

    The interpreter is on only where there is no GPU (above); where there is one, a CPU tensor
    cannot reach a compiled kernel, so such a test skips there and says why. The kernels' own
    tests (test_triton_paged_attention.py, test_triton_backend.py) put their tensors on the GPU.
    """
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU tensors need Triton's interpreter, which is off on a CUDA machine; "
                    "the Triton tests with CUDA tensors cover the kernels there")

# A tiny GQA Llama: 8 query heads share 2 KV heads (group of 4), head_dim 64 / 8 = 8.
TINY_HF_FIELDS: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-5, rope_theta=10000.0,
    # No special tokens: HF `generate` must never stop early or pad.
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

# A small hand-written config.json (HF names) for calculator / CLI tests.
SMALL_CONFIG_JSON: dict[str, Any] = dict(
    model_type="llama", vocab_size=100, hidden_size=48, intermediate_size=80,
    num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
    max_position_embeddings=256, rope_theta=10000.0,
)


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    """A saved HF checkpoint folder and the HF model (eval, fp32) that wrote it."""

    path: Path
    hf_model: Any  # transformers.LlamaForCausalLM
    fields: dict

    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[num_tokens, vocab] float32 logits of the HF model for one sequence."""
        with torch.no_grad():
            return self.hf_model(torch.tensor([token_ids])).logits[0].float()

    def hf_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """HF `generate(do_sample=False)`: the generated ids only (prompt excluded)."""
        with torch.no_grad():
            out = self.hf_model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy decoding does not collapse onto one token.

    HF's default init (std 0.02) gives near-uniform logits; here each matrix has std 1/sqrt(fan_in)
    and each norm weight is 1 + 0.1 noise, so logits differ by O(1) between tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def build_hf_checkpoint(folder: Path, seed: int = 0, **overrides: Any) -> HFCheckpoint:
    """Build a random fp32 HF LlamaForCausalLM with TINY_HF_FIELDS + overrides and save it."""
    import transformers

    fields = {**TINY_HF_FIELDS, **overrides}
    hf_config = transformers.LlamaConfig(**fields)
    torch.manual_seed(seed)
    hf_model = transformers.LlamaForCausalLM(hf_config).float().eval()
    _randomise(hf_model, seed)
    hf_model.save_pretrained(folder)
    return HFCheckpoint(Path(folder), hf_model, fields)


@pytest.fixture(scope="session")
def make_hf_checkpoint(tmp_path_factory) -> Callable[..., HFCheckpoint]:
    """Factory: make_hf_checkpoint(**overrides) -> HFCheckpoint, built once per distinct overrides."""
    built: dict[str, HFCheckpoint] = {}

    def make(seed: int = 0, **overrides: Any) -> HFCheckpoint:
        key = json.dumps({"seed": seed, **overrides}, sort_keys=True)
        if key not in built:
            folder = tmp_path_factory.mktemp("hf-llama")
            built[key] = build_hf_checkpoint(folder, seed=seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def hf_checkpoint(make_hf_checkpoint) -> HFCheckpoint:
    """GQA: 8 query heads over 2 KV heads, untied embeddings."""
    return make_hf_checkpoint()


@pytest.fixture(scope="session")
def hf_tied_checkpoint(make_hf_checkpoint) -> HFCheckpoint:
    """tie_word_embeddings=True: the checkpoint stores no lm_head.weight."""
    return make_hf_checkpoint(tie_word_embeddings=True)


@pytest.fixture(scope="session")
def hf_head_dim_checkpoint(make_hf_checkpoint) -> HFCheckpoint:
    """Explicit head_dim=12, different from hidden_size / num_attention_heads = 8."""
    return make_hf_checkpoint(head_dim=12)


@pytest.fixture(scope="session")
def tiny_model(hf_checkpoint):
    """kvlab's decoder loaded from `hf_checkpoint` (shared: treat as read-only)."""
    from kvlab.checkpoint import load_model

    return load_model(hf_checkpoint.path)


@pytest.fixture(scope="session")
def small_config():
    from kvlab.config import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       max_position_embeddings=128, name="tiny")


@pytest.fixture(scope="session")
def small_llama(small_config):
    from kvlab.model import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(small_config).eval()


@pytest.fixture
def write_config() -> Callable[..., Path]:
    """write_config(folder, **fields) -> path of folder/config.json (SMALL_CONFIG_JSON + fields).

    A field given as None is left out of the file.
    """

    def write(folder: Path, **fields: Any) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        raw = {key: value for key, value in {**SMALL_CONFIG_JSON, **fields}.items()
               if value is not None}
        path = folder / "config.json"
        path.write_text(json.dumps(raw))
        return path

    return write
