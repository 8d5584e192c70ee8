"""The GGUF loader on small random files written by the `gguf` library (no download needed).

The independent reference is transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`)
reading the same file: same logits (1e-4, fp32), same greedy tokens, same tokenizer and chat prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_synthetic import CONTROL_TOKENS, SHAPE, llama_cpp_permute, write_llama_gguf
from kvlab.checkpoint import load_chat_template, load_model, load_tokenizer
from kvlab.config import ConfigError
from kvlab.generate import generate
from kvlab.gguf_loader import (gguf_tensor_name_to_hf, load_gguf_model, load_gguf_state_dict,
                               read_gguf_config, unpermute_rows)

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 64, 127, 0, 42, 8, 8, 91, 23, 200, 250]
TEXTS = ["the cat in a hat", "<|im_start|>user\nhi there<|im_end|>\n", "x = 12 + 3  # ok",
         "naïve café ☕", "  leading spaces\n\n"]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def synthetic(request, tmp_path_factory):
    """(path, HF-order float32 weights written, transformers' model loaded from the file)."""
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    weights = write_llama_gguf(path, seed=3, tied=request.param)
    hf = transformers.LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                       dtype=torch.float32).eval()
    return path, weights, hf


def test_config_from_metadata(synthetic):
    path, _, hf = synthetic
    config = read_gguf_config(path)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == \
        (SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"])
    assert config.head_dim == SHAPE["hidden"] // SHAPE["heads"]
    assert config.num_hidden_layers == SHAPE["layers"]
    assert config.intermediate_size == SHAPE["intermediate"]
    assert config.max_position_embeddings == SHAPE["context"]
    assert config.vocab_size == hf.config.vocab_size == 3 + 256 + 5
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.rope_theta == 10000.0


def test_logits_equal_transformers_gguf_load(synthetic):
    path, _, hf = synthetic
    model = load_model(path)
    assert model.dtype == torch.float32
    for token_ids in (PROMPT, PROMPT[:1], list(range(40, 100))):
        with torch.no_grad():
            ours = model(torch.tensor(token_ids))
            theirs = hf(torch.tensor([token_ids])).logits[0]
        assert ours.shape == theirs.shape == (len(token_ids), 264)
        assert (ours - theirs).abs().max().item() <= 1e-4
        assert theirs.std().item() > 0.1  # not trivially flat


@pytest.mark.parametrize("path_kind", ["none", "contiguous", "paged", "paged-triton"])
def test_greedy_tokens_equal_transformers(synthetic, path_kind, request):
    path, _, hf = synthetic
    model = load_gguf_model(path)
    prompt = PROMPT[:5]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    assert len(set(expected)) >= 3  # greedy output is not degenerate
    cache, _, backend = path_kind.partition("-")
    if backend:  # the model's tensors are on the CPU: Triton's interpreter
        request.getfixturevalue("triton_on_cpu")
    ours = generate(model, prompt, 10, cache=cache, max_model_len=32, block_size=4,
                    attention_backend=backend or None).token_ids
    assert ours == expected


def test_weights_are_the_dequantized_values(synthetic):
    """Norms (F32) load exactly; quantized matrices load as the file's rounded values, close to the
    originals with the error each format allows."""
    import gguf

    path, weights, _ = synthetic
    _, tensors = load_gguf_state_dict(path)
    assert torch.equal(tensors["model.norm.weight"], torch.from_numpy(weights["model.norm.weight"]))
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    rounded = gguf.dequantize(gguf.quantize(q, gguf.GGMLQuantizationType.Q4_1),
                              gguf.GGMLQuantizationType.Q4_1)
    # The file stores the permuted rows; quantization works along rows, so rounding commutes.
    torch.testing.assert_close(tensors["model.layers.1.self_attn.q_proj.weight"],
                               torch.from_numpy(rounded), atol=1e-6, rtol=0)
    # 4-bit: 16 levels per block of 32 -> error up to half a step of the block's range.
    assert 0 < np.abs(rounded - q).max() < 0.1 * np.abs(q).max() + 0.2
    gate = tensors["model.layers.0.mlp.gate_proj.weight"]  # F16: rounding to 11 bits
    written = torch.from_numpy(weights["model.layers.0.mlp.gate_proj.weight"])
    torch.testing.assert_close(gate, written, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kinds", [
    {"embed": "F32", "attn": "F32", "ffn_gate_up": "F32", "ffn_down": "F32", "output": "F32"},
    {"embed": "BF16", "attn": "Q8_0", "ffn_gate_up": "Q5_1", "ffn_down": "Q4_0", "output": "F16"},
], ids=["f32", "mixed"])
def test_other_tensor_types(tmp_path, kinds):
    weights = write_llama_gguf(tmp_path / "m.gguf", seed=1, types=kinds)
    _, tensors = load_gguf_state_dict(tmp_path / "m.gguf")
    if kinds["attn"] == "F32":  # unquantized: every weight exactly as written, in HF row order
        for name, values in weights.items():
            assert torch.equal(tensors[name], torch.from_numpy(values)), name
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf",
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
        ours = load_gguf_model(tmp_path / "m.gguf")(torch.tensor(PROMPT))
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2 * 8, 3)  # 2 heads, head_dim 8
    stored = torch.from_numpy(llama_cpp_permute(weight.numpy(), 2))
    assert not torch.equal(stored, weight)
    # Head 0's stored rows pair channel i with channel i + 4: rows 0, 4, 1, 5, 2, 6, 3, 7.
    assert stored[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert torch.equal(unpermute_rows(stored, 2), weight)
    with pytest.raises(ValueError, match="even head_dim"):
        unpermute_rows(torch.zeros(6, 2), 2)


def test_tensor_names():
    assert gguf_tensor_name_to_hf("blk.12.attn_k.weight") == \
        "model.layers.12.self_attn.k_proj.weight"
    assert gguf_tensor_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_tensor_name_to_hf("rope_freqs.weight") is None
    with pytest.raises(KeyError, match="blk.0.ssm_conv"):
        gguf_tensor_name_to_hf("blk.0.ssm_conv.weight")


def test_tokenizer_equals_transformers_gguf_tokenizer(synthetic):
    path, _, _ = synthetic
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # Control tokens stay whole and are skipped on decode.
    ids = ours.encode("<|im_start|>user").ids
    assert ids[0] == CONTROL_TOKENS.index("<|im_start|>")
    assert ours.decode(ids) == "user"


def test_chat_template_equals_transformers(synthetic):
    path, _, _ = synthetic
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and?"}]
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    template = load_chat_template(path)
    for add in (True, False):
        assert template.render(messages, add_generation_prompt=add) == theirs.apply_chat_template(
            messages, add_generation_prompt=add, tokenize=False)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        template.render([{"content": "no role"}])


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_model(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        load_model(tmp_path / "junk.gguf")


def test_non_llama_architecture_is_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="'mamba' is not a Llama-style decoder"):
        read_gguf_config(tmp_path / "mamba.gguf")
