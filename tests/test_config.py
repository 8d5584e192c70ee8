"""kvlab.config: reading HF config.json files (both RoPE styles), presets, validation."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.config import PRESETS, ConfigError, LlamaConfig, load_config
from kvlab.model import LlamaForCausalLM
from kvlab.sizing import kv_bytes_per_token, size_report

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def small(**changes) -> LlamaConfig:
    fields = dict(vocab_size=100, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    fields.update(changes)
    return LlamaConfig(**fields)


# ---- loading from a path ---------------------------------------------------------------------

def test_config_json_path_and_checkpoint_folder_give_the_same_config(tmp_path, write_config):
    path = write_config(tmp_path / "my-model")
    raw = json.loads(path.read_text())
    from_file, from_folder = load_config(path), load_config(tmp_path / "my-model")
    assert from_file == from_folder
    assert str(path) != str(tmp_path / "my-model")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        assert getattr(from_file, field) == raw[field], field
    assert from_file.name == "my-model"  # named after the checkpoint folder
    # A str path works as well as a Path.
    assert load_config(str(path)) == from_file


def test_head_dim_derived_when_absent(tmp_path, write_config):
    config = load_config(write_config(tmp_path))  # no head_dim in the file
    assert config.head_dim == 48 // 6 == 8


def test_explicit_head_dim_is_honoured(tmp_path, write_config):
    # 48 / 6 = 8, but the file says 16 (as Mistral-Nemo / Qwen3 style configs do).
    config = load_config(write_config(tmp_path, head_dim=16))
    assert config.head_dim == 16
    # ... and the calculator uses it: 2 x 3 layers x 2 KV heads x 16 x 2 B = 384 B.
    assert kv_bytes_per_token(config, "bf16") == 2 * 3 * 2 * 16 * 2 == 384


def test_explicit_null_head_dim_is_derived(tmp_path, write_config):
    path = write_config(tmp_path)
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "head_dim": None}))
    assert load_config(tmp_path).head_dim == 8


def test_missing_num_key_value_heads_means_mha(tmp_path, write_config):
    config = load_config(write_config(tmp_path, num_key_value_heads=None))
    assert config.num_key_value_heads == config.num_attention_heads == 6
    assert config.num_queries_per_kv == 1


def test_rope_theta_and_rope_scaling_style(tmp_path, write_config):
    config = load_config(write_config(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE))
    assert config.rope_theta == 500000.0
    assert config.rope_type == "llama3"
    assert config.rope_scaling["factor"] == 8.0


def test_legacy_rope_scaling_type_key(tmp_path, write_config):
    config = load_config(write_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0}))
    assert config.rope_type == "linear"


def test_rope_parameters_style_default(tmp_path, write_config):
    path = write_config(tmp_path, rope_theta=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 123456.0})
    config = load_config(path)
    assert config.rope_theta == 123456.0
    assert config.rope_scaling is None
    assert config.rope_type == "default"


def test_rope_parameters_style_scaled(tmp_path, write_config):
    path = write_config(tmp_path, rope_theta=None,
                        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
    config = load_config(path)
    assert config.rope_theta == 500000.0
    assert config.rope_type == "llama3"


def test_no_rope_fields_default_theta(tmp_path, write_config):
    config = load_config(write_config(tmp_path, rope_theta=None))
    assert config.rope_theta == 10000.0 and config.rope_type == "default"


def test_config_written_by_transformers_save_pretrained(hf_checkpoint):
    """What current transformers writes (rope_parameters, explicit head_dim) reads back equal."""
    raw = json.loads((hf_checkpoint.path / "config.json").read_text())
    config = load_config(hf_checkpoint.path)
    hf_config = hf_checkpoint.hf_model.config
    assert config.vocab_size == hf_config.vocab_size
    assert config.hidden_size == hf_config.hidden_size
    assert config.intermediate_size == hf_config.intermediate_size
    assert config.num_hidden_layers == hf_config.num_hidden_layers
    assert config.num_attention_heads == hf_config.num_attention_heads
    assert config.num_key_value_heads == hf_config.num_key_value_heads
    assert config.head_dim == hf_config.head_dim == 8
    assert config.rms_norm_eps == hf_config.rms_norm_eps
    expected_theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta"))
    assert config.rope_theta == expected_theta == 10000.0
    assert config.rope_type == "default"
    assert config.tie_word_embeddings is False


def test_to_hf_dict_is_read_by_transformers_and_round_trips():
    import transformers

    config = PRESETS["llama-3.1-8b"]
    raw = config.to_hf_dict()
    assert LlamaConfig.from_hf_dict(raw, name=config.name) == config
    hf = transformers.LlamaConfig(**raw)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "rms_norm_eps"):
        assert getattr(hf, field) == getattr(config, field), field


def test_qwen2_has_qkv_bias_without_attention_bias_field(tmp_path, write_config):
    config = load_config(write_config(tmp_path, model_type="qwen2"))
    assert config.attention_bias is True and config.model_type == "qwen2"


def test_preset_lookup_and_group_sizes():
    assert load_config("llama-3.1-70b") is PRESETS["llama-3.1-70b"]
    seventy = PRESETS["llama-3.1-70b"]
    assert (seventy.num_hidden_layers, seventy.num_key_value_heads, seventy.head_dim) == (80, 8, 128)
    assert seventy.num_queries_per_kv == 64 // 8 == 8
    assert PRESETS["llama-2-7b"].num_queries_per_kv == 1  # MHA
    assert PRESETS["llama-3.2-1b"].head_dim == 64
    assert PRESETS["smollm2-135m"].num_queries_per_kv == 3  # a group of 3: not a power of two


# ---- errors ----------------------------------------------------------------------------------

def test_unknown_model_names_value_and_lists_presets():
    with pytest.raises(ConfigError) as info:
        load_config("llama-9-zillion")
    message = str(info.value)
    assert "llama-9-zillion" in message
    assert "llama-3.1-70b" in message


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_missing_required_field_is_named(tmp_path, write_config):
    with pytest.raises(ConfigError, match="intermediate_size"):
        load_config(write_config(tmp_path, intermediate_size=None))


def test_heads_not_divisible_by_kv_heads(tmp_path, write_config):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, num_attention_heads=6, num_key_value_heads=4))
    assert "num_attention_heads=6" in str(info.value)
    assert "num_key_value_heads=4" in str(info.value)


def test_hidden_not_divisible_by_heads_without_head_dim(tmp_path, write_config):
    with pytest.raises(ConfigError, match="hidden_size=50"):
        load_config(write_config(tmp_path, hidden_size=50))
    # With an explicit head_dim the same shape is fine.
    assert load_config(write_config(tmp_path, hidden_size=50, head_dim=8)).head_dim == 8


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 0), ("vocab_size", -3),
                                          ("head_dim", 2.5), ("num_key_value_heads", True)])
def test_non_positive_or_non_integer_sizes_rejected(field, value):
    with pytest.raises(ConfigError, match=field):
        small(**{field: value})


def test_zero_kv_heads_in_config_json_is_an_error_not_mha(tmp_path, write_config):
    """Only a *missing* num_key_value_heads means MHA; an explicit 0 is an invalid config."""
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_config(write_config(tmp_path, num_key_value_heads=0))


def test_with_changes_validates_again():
    config = small()
    assert config.with_changes(num_key_value_heads=1).num_queries_per_kv == 6
    with pytest.raises(ConfigError):
        config.with_changes(num_key_value_heads=4)
    assert config.num_key_value_heads == 2  # frozen original untouched


# ---- the decoder refuses what it does not implement; the calculator does not care -------------

def test_model_refuses_llama3_rope_scaling_calculator_accepts(tmp_path, write_config):
    config = load_config(write_config(tmp_path, rope_scaling=LLAMA3_ROPE))
    # The calculator accepts it: 2 x 3 x 2 x 8 x 2 B.
    assert size_report(config, batch=2, seq_len=10).kv_bytes_per_token == 2 * 3 * 2 * 8 * 2
    with pytest.raises(ConfigError) as info:
        LlamaForCausalLM(config)
    assert "llama3" in str(info.value)
    assert "rope_scaling" in str(info.value)


def test_model_refuses_rope_parameters_style_llama3(tmp_path, write_config):
    config = load_config(write_config(tmp_path, rope_parameters={**LLAMA3_ROPE,
                                                                 "rope_theta": 500000.0}))
    with pytest.raises(ConfigError, match="llama3"):
        LlamaForCausalLM(config)


def test_model_refuses_the_real_llama31_preset_before_allocating():
    # Raises in the constructor before any 8B-sized tensor exists (this would take 32 GB).
    with torch.device("meta"), pytest.raises(ConfigError, match="llama3"):
        LlamaForCausalLM(PRESETS["llama-3.1-8b"])
    assert size_report(PRESETS["llama-3.1-8b"]).kv_bytes_per_token == 131072


def test_model_refuses_attention_bias_and_other_architectures():
    with pytest.raises(ConfigError, match="attention_bias"):
        LlamaForCausalLM(small(attention_bias=True))
    with pytest.raises(ConfigError, match="qwen2"):
        LlamaForCausalLM(small(model_type="qwen2"))
