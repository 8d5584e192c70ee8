"""kvlab.sizing: the stage-0 figures, exact to the byte, against hand arithmetic and HF models."""

from __future__ import annotations

import pytest
import torch

from kvlab.config import PRESETS, LlamaConfig, load_config
from kvlab import sizing
from kvlab.sizing import (GPU_MEMORY_GIB, MAX_BATCH, MAX_SEQ_LEN, GpuMemory, SizingError,
                          default_kv_budget, dtype_bytes, format_bytes, gpu_memory,
                          kv_bytes_per_token, kv_heads_per_gpu, num_parameters, plural,
                          size_report, weights_bytes)

KiB, GiB = 2**10, 2**30


def cfg(layers=3, heads=8, kv_heads=8, head_dim=16, hidden=128, **extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=100, hidden_size=hidden, intermediate_size=200,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, **extra)


# ---- the course's facts ----------------------------------------------------------------------

def test_llama_31_70b_bf16_per_token_and_batch():
    config = PRESETS["llama-3.1-70b"]
    assert kv_bytes_per_token(config, "bf16") == 2 * 80 * 8 * 128 * 2 == 327_680 == 320 * KiB
    report = size_report(config, batch=128, seq_len=4096, dtype="bf16")
    assert report.kv_cache_bytes == 128 * 4096 * 327_680 == 171_798_691_840 == 160 * GiB
    assert format_bytes(report.kv_cache_bytes) == "160 GiB"
    assert format_bytes(report.kv_bytes_per_token) == "320 KiB"


def test_llama_31_70b_parameters_and_weights():
    config = PRESETS["llama-3.1-70b"]
    assert num_parameters(config) == 70_553_706_496
    assert abs(num_parameters(config) / 1e9 - 70.55) <= 0.01
    # "the 70.55 B weights need 141 GB in bf16"
    assert weights_bytes(config, "bf16") == 2 * 70_553_706_496
    assert round(weights_bytes(config, "bf16") / 1e9) == 141
    # The cache (160 GiB) outweighs the weights (131.4 GiB) at 128 x 4096.
    assert size_report(config, batch=128, seq_len=4096).kv_cache_bytes > weights_bytes(config)


@pytest.mark.parametrize("name, expected", [
    ("llama-3.1-8b", 128 * KiB),   # 2 x 32 x 8 x 128 x 2
    ("llama-3.1-405b", 504 * KiB),  # 2 x 126 x 8 x 128 x 2
    ("llama-2-7b", 512 * KiB),      # 2 x 32 x 32 x 128 x 2 (MHA)
])
def test_published_kv_bytes_per_token(name, expected):
    assert kv_bytes_per_token(PRESETS[name], "bf16") == expected


def test_gqa_with_8_kv_heads_cuts_llama2_cache_4x():
    mha = PRESETS["llama-2-7b"]
    gqa = mha.with_changes(num_key_value_heads=8)
    assert kv_bytes_per_token(mha) == 4 * kv_bytes_per_token(gqa)
    assert kv_bytes_per_token(mha) == 4 * kv_bytes_per_token(PRESETS["llama-3.1-8b"])


@pytest.mark.parametrize("name, billions", [("llama-3.1-8b", 8.03), ("llama-3.2-1b", 1.24),
                                            ("qwen2.5-7b", 7.62)])
def test_parameter_counts_match_published(name, billions):
    assert abs(num_parameters(PRESETS[name]) / 1e9 - billions) < 0.005


def _hf_meta_model(config: LlamaConfig):
    """The HF model of this shape on the meta device (no memory): an independent parameter count."""
    import transformers

    raw = config.to_hf_dict()
    with torch.device("meta"):
        if config.model_type == "qwen2":
            raw.pop("attention_bias")
            return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**raw))
        if config.model_type == "mistral":
            return transformers.MistralForCausalLM(transformers.MistralConfig(**raw))
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**raw))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "qwen2.5-7b",
                                  "smollm2-135m", "mistral-7b"])
def test_parameter_counts_equal_transformers_models(name):
    config = PRESETS[name]
    model = _hf_meta_model(config)
    # parameters() yields a tied embedding once, as num_parameters must count it.
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())


def test_parameter_count_with_llama_attention_bias_equals_transformers():
    config = cfg(layers=2, heads=8, kv_heads=2, head_dim=16, hidden=64, attention_bias=True)
    model = _hf_meta_model(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())


def test_kv_bytes_per_token_equals_a_real_hf_cache(hf_checkpoint, hf_head_dim_checkpoint):
    """Count the bytes of HF's own DynamicCache after a prefill of T tokens."""
    for checkpoint in (hf_checkpoint, hf_head_dim_checkpoint):
        num_tokens = 7
        with torch.no_grad():
            out = checkpoint.hf_model(torch.arange(num_tokens)[None], use_cache=True)
        cache = out.get("cache") or out.get("past_key_values")
        if hasattr(cache, "layers"):
            tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        else:  # older transformers
            tensors = list(cache.key_cache) + list(cache.value_cache)
        total = sum(t.numel() * t.element_size() for t in tensors)
        config = load_config(checkpoint.path)
        assert total == num_tokens * kv_bytes_per_token(config, "fp32")


# ---- hand-derived MHA / GQA / MQA / dtype / tp -------------------------------------------------

@pytest.mark.parametrize("kv_heads, dtype, expected", [
    (8, "fp32", 2 * 3 * 8 * 16 * 4),  # MHA: 3072
    (8, "fp16", 2 * 3 * 8 * 16 * 2),  # 1536
    (2, "bf16", 2 * 3 * 2 * 16 * 2),  # GQA, group of 4: 384
    (1, "bf16", 2 * 3 * 1 * 16 * 2),  # MQA: 192
    (2, "fp8", 2 * 3 * 2 * 16 * 1),   # 192
    (2, "float32", 2 * 3 * 2 * 16 * 4),
    (2, "BF16", 2 * 3 * 2 * 16 * 2),
])
def test_hand_derived_kv_bytes(kv_heads, dtype, expected):
    assert kv_bytes_per_token(cfg(kv_heads=kv_heads), dtype) == expected


def test_dtype_bytes_and_unknown_dtype():
    assert [dtype_bytes(d) for d in ("fp32", "bf16", "fp16", "fp8")] == [4, 2, 2, 1]
    with pytest.raises(SizingError, match="'fp4'"):
        dtype_bytes("fp4")
    with pytest.raises(SizingError, match="'int3'"):
        kv_bytes_per_token(cfg(), "int3")


@pytest.mark.parametrize("tp, heads_per_gpu", [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1), (32, 1)])
def test_tp_splits_then_replicates_kv_heads(tp, heads_per_gpu):
    config = PRESETS["llama-3.1-70b"]
    assert kv_heads_per_gpu(config, tp) == heads_per_gpu
    assert kv_bytes_per_token(config, "bf16", tp) == 2 * 80 * heads_per_gpu * 128 * 2


def test_tp_report_totals_count_replicas():
    config = PRESETS["llama-3.1-70b"]
    at_8 = size_report(config, batch=1, seq_len=1000, tp=8)
    assert at_8.kv_bytes_per_token == 40_960 and at_8.kv_bytes_per_token_total == 327_680
    at_16 = size_report(config, batch=1, seq_len=1000, tp=16)
    assert at_16.kv_heads_per_gpu == 1
    assert at_16.kv_bytes_per_token == 40_960
    assert at_16.kv_bytes_per_token_total == 16 * 40_960  # each head stored twice
    assert at_16.kv_cache_bytes == 1000 * 40_960


@pytest.mark.parametrize("tp", [3, 5, 12, 0, -2])
def test_tp_that_does_not_divide_is_a_clear_error(tp):
    with pytest.raises(SizingError, match=f"tp={tp}|got {tp}"):
        kv_bytes_per_token(PRESETS["llama-3.1-70b"], "bf16", tp)
    with pytest.raises(SizingError):
        size_report(PRESETS["llama-3.1-70b"], tp=tp)


def test_tp_must_also_split_the_query_heads():
    """SmolLM2-135M has 9 query heads over 3 KV heads. tp=6 replicates the 3 KV heads evenly, but
    9 query heads cannot be split over 6 GPUs (vLLM refuses: num_attention_heads % tp != 0);
    counting 9 // 6 = 1 query head per GPU would drop a third of the attention weights."""
    config = PRESETS["smollm2-135m"]
    assert kv_heads_per_gpu(config, 3) == 1  # 9 / 3 and 3 / 3: fine
    with pytest.raises(SizingError, match="tp=6"):
        weights_bytes(config, "bf16", tp=6)
    with pytest.raises(SizingError, match="tp=6"):
        size_report(config, tp=6)


def test_weights_per_gpu_under_tp_by_hand():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=8)
    # tp=1: attention 64*8*(8+8+2+2) = 10240, mlp 3*64*96 = 18432, norms 128 per layer;
    # embedding + lm_head 2*128*64 = 16384; final norm 64.
    assert num_parameters(config) == 2 * (10240 + 18432 + 128) + 16384 + 64 == 74048
    # tp=2: q/o 4 heads, k/v 1 head each: 64*8*(4+4+1+1) = 5120; mlp 9216; norms replicated 128;
    # embedding and lm_head halves 2*4096; final norm 64.
    assert weights_bytes(config, "fp32", tp=2) == 4 * (2 * (5120 + 9216 + 128) + 8192 + 64)
    assert weights_bytes(config, "bf16", tp=1) == 2 * 74048


def test_parameter_count_of_tiny_hf_checkpoint(hf_checkpoint, hf_tied_checkpoint,
                                               hf_head_dim_checkpoint):
    for checkpoint in (hf_checkpoint, hf_tied_checkpoint, hf_head_dim_checkpoint):
        count = sum(p.numel() for p in checkpoint.hf_model.parameters())
        assert num_parameters(load_config(checkpoint.path)) == count


# ---- size_report: GPU fit --------------------------------------------------------------------

def test_no_gpu_means_no_fit():
    report = size_report(PRESETS["llama-3.1-70b"], batch=128, seq_len=4096)
    assert report.max_concurrent_requests is None
    assert report.gpu is None and report.gpu_memory_bytes is None and report.usable_bytes is None


def test_fit_on_h100_by_hand():
    config = PRESETS["llama-3.1-8b"]
    report = size_report(config, batch=1, seq_len=4096, gpu="h100-80gb")
    usable = 80 * GiB * 9 // 10  # 77,309,411,328 B
    weights = 2 * 8_030_261_248
    assert report.gpu == "H100-80GB"
    assert report.gpu_memory_bytes == 80 * GiB
    assert report.usable_bytes == usable
    assert report.max_concurrent_requests == (usable - weights) // (4096 * 131_072) == 114
    assert report.weights_share_of_gpu == pytest.approx(weights / (80 * GiB))


def test_weights_bigger_than_gpu_fit_zero():
    report = size_report(PRESETS["llama-3.1-70b"], seq_len=4096, gpu="H100-80GB")
    assert report.max_concurrent_requests == 0


def test_fit_with_gpu_mem_and_tp():
    config = PRESETS["llama-3.1-70b"]
    # 192 GiB x 0.9 = 185,542,587,187.2 -> 185,542,587,187 B usable.
    report = size_report(config, seq_len=4096, gpu_mem_gib=192)
    assert report.usable_bytes == 185_542_587_187
    assert report.max_concurrent_requests == (185_542_587_187 - 141_107_412_992) // (4096 * 327_680)
    assert report.max_concurrent_requests == 33
    # tp=4 on 80 GiB cards: each holds a quarter of the matrices and 2 KV heads.
    at_tp4 = size_report(config, seq_len=4096, tp=4, gpu="H100-80GB")
    per_gpu_weights = weights_bytes(config, "bf16", tp=4)
    assert at_tp4.max_concurrent_requests == (80 * GiB * 9 // 10 - per_gpu_weights) // (4096 * 81_920)


def test_size_report_bad_values():
    config = PRESETS["llama-3.1-8b"]
    with pytest.raises(SizingError, match="batch.*0"):
        size_report(config, batch=0)
    with pytest.raises(SizingError, match="seq_len.*-5"):
        size_report(config, seq_len=-5)
    with pytest.raises(SizingError, match="'Z80'"):
        size_report(config, gpu="Z80")
    with pytest.raises(SizingError, match="1.5"):
        size_report(config, gpu="H100-80GB", gpu_memory_utilization=1.5)
    with pytest.raises(SizingError):
        size_report(config, gpu_mem_gib=-1)


def test_gpu_table_units():
    assert GPU_MEMORY_GIB["H100-80GB"] == 80 and GPU_MEMORY_GIB["A100-40GB"] == 40


@pytest.mark.parametrize("num_bytes, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"),
                                             (1536, "1.5 KiB"), (327_680, "320 KiB"),
                                             (160 * GiB, "160 GiB"), (3 * 2**40, "3 TiB"),
                                             (5 * 2**50, "5120 TiB")])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


# ---- the default KV budget, GPU memory figures, bounds -----------------------------------------

def test_default_kv_budget_by_hand():
    """int(0.9 x 80 GiB) - bf16 weights of Llama-3.1-8B: what kvlab report and the notebooks use."""
    config = PRESETS["llama-3.1-8b"]
    budget = default_kv_budget(config)
    assert budget == 77_309_411_328 - 16_060_522_496 == 61_248_888_832
    assert default_kv_budget(config, "L4", gpu_memory_utilization=0.5) == \
        12 * GiB - 16_060_522_496 < 0  # negative: the weights alone overflow half an L4
    assert default_kv_budget(config, dtype="fp8", gpu_memory_bytes=10**10) == 9 * 10**9 - 8_030_261_248
    # Under tp=8, each GPU holds an eighth of the matrices (norms replicated).
    assert default_kv_budget(PRESETS["llama-3.1-70b"], "H100-80GB", tp=8) == (
        77_309_411_328 - weights_bytes(PRESETS["llama-3.1-70b"], "bf16", tp=8))
    with pytest.raises(SizingError, match="1.2"):
        default_kv_budget(config, gpu_memory_utilization=1.2)
    with pytest.raises(SizingError, match="'Z80'"):
        default_kv_budget(config, "Z80")


def test_gpu_memory_sources(monkeypatch):
    named = gpu_memory("h200")
    assert named == GpuMemory("H200", 141 * GiB, "nominal, vendor datasheet")
    assert gpu_memory(gpu_mem_gib=1.5) == GpuMemory("1.5 GiB GPU", 3 * 2**29, "given")
    assert gpu_memory() is None
    monkeypatch.setattr(sizing, "local_gpu_memory", lambda: None)
    with pytest.raises(SizingError, match="no GPU"):
        gpu_memory("local")
    card = GpuMemory("NVIDIA X", 123, "reported by torch.cuda")
    monkeypatch.setattr(sizing, "local_gpu_memory", lambda: card)
    assert gpu_memory("local") is card
    assert default_kv_budget(PRESETS["smollm2-135m"], "local", gpu_memory_utilization=1.0) == \
        123 - weights_bytes(PRESETS["smollm2-135m"])
    with pytest.raises(SizingError, match="16,384"):
        gpu_memory(gpu_mem_gib=10**6)


def test_local_gpu_memory_is_what_torch_cuda_reports():
    found = sizing.local_gpu_memory()
    if not torch.cuda.is_available():
        assert found is None
        return
    assert found.total_bytes == torch.cuda.get_device_properties(0).total_memory
    assert found.source == "reported by torch.cuda"


def test_inputs_are_bounded():
    config = PRESETS["llama-3.1-8b"]
    assert size_report(config, seq_len=MAX_SEQ_LEN, batch=MAX_BATCH).kv_cache_bytes == \
        MAX_SEQ_LEN * MAX_BATCH * 131_072  # 2 EiB: the largest figure it will print
    with pytest.raises(SizingError, match="16,777,216"):
        size_report(config, seq_len=MAX_SEQ_LEN + 1)
    with pytest.raises(SizingError, match="1,048,576"):
        size_report(config, batch=MAX_BATCH + 1)


def test_kv_cache_dtype_is_apart_from_the_weights_dtype():
    config = PRESETS["llama-3.1-70b"]
    report = size_report(config, dtype="bf16", kv_cache_dtype="fp8", gpu="H200")
    assert report.kv_bytes_per_token == 163_840 and report.weights_bytes == 2 * 70_553_706_496
    same = size_report(config, dtype="fp8")
    assert same.kv_cache_dtype == "fp8" and same.weights_bytes == 70_553_706_496


def test_plural():
    assert [plural(n, "request") for n in (0, 1, 2, 10_000)] == [
        "0 requests", "1 request", "2 requests", "10,000 requests"]


def test_sizing_speaks_the_one_dtype_vocabulary():
    """Names, long names and torch dtypes are all accepted (kvlab.dtypes), reports hold short names."""
    config = PRESETS["llama-3.1-8b"]
    assert kv_bytes_per_token(config, torch.bfloat16) == kv_bytes_per_token(config, "bfloat16") \
        == kv_bytes_per_token(config, "bf16") == 131_072
    assert weights_bytes(config, torch.float8_e4m3fn) == 8_030_261_248
    report = size_report(config, dtype=torch.float16, kv_cache_dtype="float8")
    assert (report.dtype, report.kv_cache_dtype) == ("fp16", "fp8")
    assert default_kv_budget(config, dtype=torch.bfloat16) == default_kv_budget(config)
    with pytest.raises(SizingError, match="fp4"):
        kv_bytes_per_token(config, "fp4")
    with pytest.raises(SizingError, match="torch.int8|int8"):
        size_report(config, kv_cache_dtype=torch.int8)


def test_one_table_of_cards_serves_sizing_and_the_clock():
    from kvlab.gpus import CARDS, get_card
    from kvlab.serving import CostModel

    # Sizing reads the same card the clock does: one home for a card's figures.
    assert gpu_memory("h200").total_bytes == get_card("H200").memory_bytes == 141 * 2**30
    assert GPU_MEMORY_GIB == {name: card.memory_gib for name, card in CARDS.items()}
    # A card kvlab can size but has no bandwidth or FLOP/s for cannot time a step.
    assert gpu_memory("T4").total_bytes == 16 * 2**30
    with pytest.raises(SizingError, match="no roofline figures for GPU 'T4'; known: L4, A100"):
        get_card("T4")
    with pytest.raises(ValueError, match="T4: no bandwidth or FLOP/s"):
        CostModel(load_config("llama-3.1-8b"), CARDS["T4"])
