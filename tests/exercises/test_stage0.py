"""Stage 0: the KV-size calculator, checked against published figures and `kvlab.sizing`.

Grades `stage0_kv_size.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 0`.
"""

from __future__ import annotations

import pytest

from kvlab import sizing
from kvlab.config import PRESETS
from kvlab.tools.grading import assert_equal

GiB = 2**30

# Presets without attention biases (the exercise's num_parameters counts a bias-free decoder).
LLAMA_PRESETS = [name for name, config in PRESETS.items() if not config.attention_bias]


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage0_kv_size.py")


# ---- kv_bytes_per_token -----------------------------------------------------------------------

@pytest.mark.parametrize("layers, kv_heads, head_dim, dtype_bytes, expected, model", [
    (80, 8, 128, 2, 327_680, "llama-3.1-70b bf16 = 320 KiB"),
    (32, 8, 128, 2, 131_072, "llama-3.1-8b bf16 = 128 KiB"),
    (126, 8, 128, 2, 516_096, "llama-3.1-405b bf16 = 504 KiB"),
    (32, 32, 128, 2, 524_288, "llama-2-7b bf16, MHA = 512 KiB"),
    (32, 8, 128, 4, 262_144, "llama-3.1-8b fp32"),
    (32, 8, 128, 1, 65_536, "llama-3.1-8b fp8"),
], ids=["llama-3.1-70b", "llama-3.1-8b", "llama-3.1-405b", "llama-2-7b", "fp32", "fp8"])
def test_kv_bytes_per_token_published(ex, layers, kv_heads, head_dim, dtype_bytes, expected,
                                      model):
    got = ex.kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes)
    assert_equal(got, expected, f"kv_bytes_per_token(layers={layers}, kv_heads={kv_heads}, "
                                f"head_dim={head_dim}, bytes={dtype_bytes}) [{model}]")


@pytest.mark.parametrize("name", list(PRESETS))
def test_kv_bytes_per_token_matches_kvlab(ex, name):
    config = PRESETS[name]
    for dtype in ("bf16", "fp32"):
        args = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                sizing.dtype_bytes(dtype))
        assert_equal(ex.kv_bytes_per_token(*args), sizing.kv_bytes_per_token(config, dtype),
                     f"kv_bytes_per_token{args} [{name} {dtype}, as kvlab.sizing]")


def test_gqa_cuts_the_cache(ex):
    mha = ex.kv_bytes_per_token(32, 32, 128, 2)
    gqa = ex.kv_bytes_per_token(32, 8, 128, 2)
    assert_equal(mha // gqa if gqa else None, 4,
                 "MHA (32 KV heads) / GQA (8 KV heads) bytes per token")


# ---- kv_cache_bytes ---------------------------------------------------------------------------

def test_kv_cache_bytes_70b(ex):
    got = ex.kv_cache_bytes(128, 4096, 327_680)
    assert_equal(got, 171_798_691_840,
                 "kv_cache_bytes(batch=128, seq_len=4096, bytes_per_token=327680) [= 160 GiB]")


@pytest.mark.parametrize("name, batch, seq_len", [
    ("llama-3.1-8b", 1, 1), ("llama-3.1-8b", 1, 4096), ("llama-2-7b", 7, 1000),
    ("llama-3.1-405b", 256, 8192)])
def test_kv_cache_bytes_matches_kvlab(ex, name, batch, seq_len):
    config = PRESETS[name]
    per_token = sizing.kv_bytes_per_token(config)
    expected = sizing.size_report(config, batch=batch, seq_len=seq_len).kv_cache_bytes
    assert_equal(ex.kv_cache_bytes(batch, seq_len, per_token), expected,
                 f"kv_cache_bytes(batch={batch}, seq_len={seq_len}, bytes_per_token={per_token}) "
                 f"[{name}, as kvlab.sizing.size_report]")


def test_cache_outweighs_the_weights_for_70b(ex):
    config = PRESETS["llama-3.1-70b"]
    cache = ex.kv_cache_bytes(128, 4096, sizing.kv_bytes_per_token(config))
    weights = sizing.weights_bytes(config)
    assert cache is not None and cache > weights, (
        f"128 x 4096 tokens of llama-3.1-70b: expected a KV cache larger than the "
        f"{weights:,} B of bf16 weights, got {cache!r}")


# ---- max_concurrent_requests ------------------------------------------------------------------

@pytest.mark.parametrize("name, gpu_gib, seq_len", [
    ("llama-3.1-8b", 80, 4096), ("llama-3.1-8b", 24, 8192), ("llama-2-7b", 40, 4096),
    ("mistral-7b", 141, 32768), ("llama-3.2-1b", 16, 2048)])
def test_max_concurrent_requests_matches_size_report(ex, name, gpu_gib, seq_len):
    config = PRESETS[name]
    expected = sizing.size_report(config, seq_len=seq_len, gpu_mem_gib=gpu_gib,
                                  gpu_memory_utilization=1.0).max_concurrent_requests
    args = (gpu_gib * GiB, sizing.weights_bytes(config), seq_len,
            sizing.kv_bytes_per_token(config))
    assert_equal(ex.max_concurrent_requests(*args), expected,
                 f"max_concurrent_requests(gpu_bytes={gpu_gib} GiB, weights_bytes={args[1]:,}, "
                 f"seq_len={seq_len}, bytes_per_token={args[3]:,}) [{name}]")


def test_max_concurrent_requests_weights_do_not_fit(ex):
    config = PRESETS["llama-3.1-70b"]
    args = (80 * GiB, sizing.weights_bytes(config), 4096, sizing.kv_bytes_per_token(config))
    assert_equal(ex.max_concurrent_requests(*args), 0,
                 f"max_concurrent_requests(gpu_bytes=80 GiB, weights_bytes={args[1]:,} (more "
                 f"than the GPU), seq_len=4096, bytes_per_token={args[3]:,})")


def test_max_concurrent_requests_rounds_down(ex):
    # 10,000 free bytes, 3,000 bytes per request: 3 whole requests, not 3.33 and not 4.
    assert_equal(ex.max_concurrent_requests(12_000, 2_000, 30, 100), 3,
                 "max_concurrent_requests(gpu_bytes=12000, weights_bytes=2000, seq_len=30, "
                 "bytes_per_token=100)")


# ---- num_parameters ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("llama-3.1-70b", 70_553_706_496), ("llama-3.1-8b", 8_030_261_248)])
def test_num_parameters_published(ex, name, expected):
    assert_equal(ex.num_parameters(PRESETS[name]), expected, f"num_parameters({name})")


@pytest.mark.parametrize("name", LLAMA_PRESETS)
def test_num_parameters_matches_kvlab(ex, name):
    config = PRESETS[name]
    note = ", tied embeddings: count them once" if config.tie_word_embeddings else ""
    assert_equal(ex.num_parameters(config), sizing.num_parameters(config),
                 f"num_parameters({name}) [as kvlab.sizing{note}]")
