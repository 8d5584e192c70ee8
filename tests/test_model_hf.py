"""kvlab's decoder against Hugging Face transformers' LlamaForCausalLM on the same random weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlab.checkpoint import load_model, resolve_model_dir, save_model
from kvlab.config import load_config
from kvlab.generate import generate
from kvlab.memory import measure

CHECKPOINTS = ["hf_checkpoint", "hf_tied_checkpoint", "hf_head_dim_checkpoint"]
PROMPT = [5, 17, 99, 3, 64, 127, 0, 42, 8, 8, 91, 23]


def sequence(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_logits_equal_hf(fixture, request):
    checkpoint = request.getfixturevalue(fixture)
    model = load_model(checkpoint.path)
    for token_ids in (PROMPT, sequence(1, seed=1), sequence(48, seed=2)):
        with torch.no_grad():
            ours = model(torch.tensor(token_ids))
        theirs = checkpoint.hf_logits(token_ids)
        assert ours.shape == theirs.shape == (len(token_ids), 128)
        assert ours.dtype == torch.float32
        assert (ours - theirs).abs().max().item() <= 1e-4
        # The logits are not trivially flat, so the comparison means something.
        assert theirs.std().item() > 0.1


@pytest.mark.parametrize("fixture", CHECKPOINTS)
@pytest.mark.parametrize("cache", ["none", "contiguous"])
def test_greedy_tokens_equal_hf_generate(fixture, cache, request):
    checkpoint = request.getfixturevalue(fixture)
    model = load_model(checkpoint.path)
    for prompt in (PROMPT[:3], PROMPT[:1]):
        expected = checkpoint.hf_greedy(prompt, max_new_tokens=12)
        assert len(expected) == 12
        result = generate(model, prompt, 12, cache=cache, max_model_len=32)
        assert result.token_ids == expected


def test_greedy_is_not_degenerate(hf_checkpoint):
    """Guard for the fixture itself: greedy output visits several tokens."""
    assert len(set(hf_checkpoint.hf_greedy(PROMPT[:3], 12))) >= 4


def test_checkpoint_layout_and_tied_weights(hf_checkpoint, hf_tied_checkpoint):
    untied = load_file(str(hf_checkpoint.path / "model.safetensors"))
    tied = load_file(str(hf_tied_checkpoint.path / "model.safetensors"))
    assert "lm_head.weight" in untied and "lm_head.weight" not in tied
    model = load_model(hf_tied_checkpoint.path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight,
                               hf_tied_checkpoint.hf_model.get_input_embeddings().weight)
    # Tied weights counted once: exactly HF's deduplicated parameter bytes.
    hf_bytes = sum(p.numel() * 4 for p in hf_tied_checkpoint.hf_model.parameters())
    assert model.weights_bytes == measure(model).weights_bytes == hf_bytes
    assert hf_bytes == 4 * (sum(t.numel() for t in tied.values()))


def test_every_checkpoint_tensor_is_loaded(hf_checkpoint):
    model = load_model(hf_checkpoint.path)
    state = model.state_dict()
    for name, tensor in load_file(str(hf_checkpoint.path / "model.safetensors")).items():
        assert torch.equal(state[name], tensor), name


def test_load_in_lower_precision(hf_checkpoint):
    model = load_model(hf_checkpoint.path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT))
    assert logits.dtype == torch.float32
    theirs = hf_checkpoint.hf_logits(PROMPT)
    # bf16 has 8 bits of mantissa: close, not equal.
    assert (logits - theirs).abs().max().item() < 0.5
    assert (logits - theirs).abs().mean().item() < 0.1


def rotate_float64(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float):
    """RoPE by its definition, in float64: pair channel i with i + head_dim/2, angle p * theta^(-2i/d)."""
    exponents = torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim
    angles = positions.double()[:, None] * theta ** -exponents
    cos = torch.cat([angles, angles], -1).cos()[:, None, :]
    sin = torch.cat([angles, angles], -1).sin()[:, None, :]
    x = x.double()
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_load_keeps_rope_frequencies_in_float32(hf_checkpoint, dtype):
    """HF keeps RoPE's inv_freq in float32 when it loads a checkpoint in bf16/fp16; rounding the
    frequencies to 8 (bf16) mantissa bits turns position 4,000 into a rotation off by radians."""
    import transformers

    model = load_model(hf_checkpoint.path, dtype=dtype)
    rope = model.model.layers[0].self_attn.rope
    config = load_config(hf_checkpoint.path)
    x = torch.randn(3, 2, config.head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions = torch.tensor([5, 1000, 4000])
    expected = rotate_float64(x, positions, config.head_dim, config.rope_theta)
    # Output rounded to bf16/fp16 once: within a few units in the last place of O(1) values.
    torch.testing.assert_close(rope(x, positions).double(), expected, atol=3e-2, rtol=3e-2)

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_checkpoint.path, dtype=dtype)
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq(torch.device("cpu")), hf.model.rotary_emb.inv_freq, atol=0,
                               rtol=1e-6)


def test_save_model_is_read_by_transformers(hf_head_dim_checkpoint, tmp_path):
    import transformers

    model = load_model(hf_head_dim_checkpoint.path)
    save_model(model, tmp_path / "saved")
    raw = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert raw["head_dim"] == 12
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").float().eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
        ours = model(torch.tensor(PROMPT))
    assert (ours - theirs).abs().max().item() <= 1e-4
    # And kvlab reads it back to identical weights.
    again = load_model(tmp_path / "saved")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_save_model_tied_drops_lm_head(hf_tied_checkpoint, tmp_path):
    model = load_model(hf_tied_checkpoint.path)
    save_model(model, tmp_path, dtype=torch.float16)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in stored
    assert all(t.dtype == torch.float16 for t in stored.values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float16"


def test_load_model_errors(hf_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    # A config but no weights.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(
        (hf_checkpoint.path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path / "empty")
    # A weight missing: named in the error.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hf_checkpoint.path / "config.json").read_text())
    tensors = load_file(str(hf_checkpoint.path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(KeyError) as info:
        load_model(broken)
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value)
    assert "model.layers.9.extra.weight" in str(info.value)


def test_resolve_named_models_and_paths(hf_checkpoint):
    assert resolve_model_dir(hf_checkpoint.path) == hf_checkpoint.path
    assert resolve_model_dir(str(hf_checkpoint.path)) == hf_checkpoint.path
    assert load_config(hf_checkpoint.path).num_key_value_heads == 2


def test_logits_at_explicit_positions_match_full_forward(tiny_model):
    """RoPE makes attention depend on relative positions only: the same sequence placed at
    positions 17..28 instead of 0..11 gives the same logits (positions are honoured and applied
    identically to queries and keys)."""
    token_ids = torch.tensor(PROMPT)
    with torch.no_grad():
        base = tiny_model(token_ids)
        shifted = tiny_model(token_ids, positions=torch.arange(len(PROMPT)) + 17)
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
