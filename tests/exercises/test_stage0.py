"""Stage 0: the KV calculator for three layouts the page did not size -- tensor parallelism past the
KV heads (checked against `kvlab.sizing`, which replicates heads as vLLM does), a sliding window
(Mistral 7B's published 8x) and a latent cache (DeepSeek-V2's published 4.5 head_dims a layer).

Grades `stage0_kv_size.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 0`.
"""

from __future__ import annotations

import pytest

from kvlab import sizing
from kvlab.config import PRESETS
from kvlab.tools.grading import assert_equal, expect_raises

GiB = 2**30


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage0_kv_size.py")


def call(name, **args):
    """'kv_bytes_per_token_per_gpu(num_hidden_layers=80, ..., tp=16)' for messages."""
    return f"{name}({', '.join(f'{key}={value}' for key, value in args.items())})"


# ---- tensor parallelism: each GPU's share of the KV heads, whole heads only --------------------

def tp_hint(got, layers, kv_heads, head_dim, dtype_bytes, tp):
    """What a wrong per-GPU figure most likely means, for the failure line."""
    whole_model = 2 * layers * kv_heads * head_dim * dtype_bytes
    if tp > kv_heads and got == whole_model // tp:
        return (" -- your figure is the whole model's divided by tp: past tp = "
                "num_key_value_heads a GPU cannot hold part of a head, so it keeps 1 whole head "
                "(each head replicated on tp / num_key_value_heads GPUs)")
    if got == 0:
        return " -- 0 bytes: num_key_value_heads // tp is 0 past tp = num_key_value_heads"
    if got == whole_model:
        return " -- that is the whole model's figure: each GPU holds only its share of the heads"
    return ""


def check_tp(ex, layers, kv_heads, head_dim, dtype_bytes, tp, expected, note):
    what = call("kv_bytes_per_token_per_gpu", num_hidden_layers=layers,
                num_key_value_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, tp=tp)
    got = ex.kv_bytes_per_token_per_gpu(layers, kv_heads, head_dim, dtype_bytes, tp)
    try:
        assert_equal(got, expected, f"{what} [{note}]")
    except AssertionError as error:
        hint = (tp_hint(got, layers, kv_heads, head_dim, dtype_bytes, tp)
                if isinstance(got, int) else "")
        raise AssertionError(f"{error}{hint}") from None


@pytest.mark.parametrize("layers, kv_heads, head_dim, dtype_bytes, tp, expected, note", [
    (80, 8, 128, 2, 1, 327_680, "llama-3.1-70b on 1 GPU: the page's 320 KiB"),
    (80, 8, 128, 2, 8, 40_960, "llama-3.1-70b on 8 GPUs: 1 KV head each, the page's calculator"),
    (80, 8, 128, 2, 16, 40_960, "llama-3.1-70b on 16 GPUs: still 1 whole KV head each"),
    (28, 4, 128, 2, 8, 14_336, "qwen2.5-7b, 4 KV heads on 8 GPUs"),
    (32, 8, 128, 1, 2, 32_768, "llama-3.1-8b in fp8 on 2 GPUs: 4 KV heads each"),
], ids=["70b-tp1", "70b-tp8", "70b-tp16", "qwen-tp8", "8b-fp8-tp2"])
def test_kv_bytes_per_gpu_by_hand(ex, layers, kv_heads, head_dim, dtype_bytes, tp, expected,
                                  note):
    check_tp(ex, layers, kv_heads, head_dim, dtype_bytes, tp, expected, note)


@pytest.mark.parametrize("name", list(PRESETS))
def test_kv_bytes_per_gpu_matches_kvlab(ex, name):
    """Every preset on 1 to 32 GPUs, wherever the query heads split evenly (kvlab.sizing and vLLM
    refuse the rest for the query heads' sake, which this function does not see)."""
    config = PRESETS[name]
    args = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 2)
    for tp in (1, 2, 3, 4, 8, 16, 32):
        if config.num_attention_heads % tp:
            continue
        try:
            expected = sizing.kv_bytes_per_token(config, "bf16", tp)
        except sizing.SizingError:  # the KV heads cannot be shared out: yours must refuse too
            expect_raises(ValueError, lambda: ex.kv_bytes_per_token_per_gpu(*args, tp),
                          call("kv_bytes_per_token_per_gpu", num_hidden_layers=args[0],
                               num_key_value_heads=args[1], head_dim=args[2], dtype_bytes=2,
                               tp=tp) + f" [{name}]")
            continue
        check_tp(ex, *args, tp, expected, f"{name} bf16 on {tp} GPUs, as kvlab.sizing")


@pytest.mark.parametrize("kv_heads, tp", [(8, 3), (8, 12), (4, 6), (32, 48)],
                         ids=["8-heads-tp3", "8-heads-tp12", "4-heads-tp6", "32-heads-tp48"])
def test_an_uneven_tp_is_refused(ex, kv_heads, tp):
    what = call("kv_bytes_per_token_per_gpu", num_hidden_layers=32, num_key_value_heads=kv_heads,
                head_dim=128, dtype_bytes=2, tp=tp)
    error = expect_raises(ValueError,
                          lambda: ex.kv_bytes_per_token_per_gpu(32, kv_heads, 128, 2, tp),
                          f"{what} [the heads cannot be shared out evenly]")
    message = str(error)
    assert str(tp) in message and str(kv_heads) in message, (
        f"{what}: the ValueError should name tp={tp} and num_key_value_heads={kv_heads}, "
        f"got {message!r}")


def test_kv_bytes_per_gpu_is_written_not_borrowed(ex, monkeypatch):
    # kvlab.sizing computes the same figure (the grader compares with it): calling it passes every
    # other check and teaches nothing.
    def borrowed(*args, **kwargs):
        raise AssertionError("kv_bytes_per_token_per_gpu(...) calls kvlab.sizing: write the rule "
                             "yourself (read kvlab.sizing.kv_heads_per_gpu when you are done)")
    for name in ("kv_heads_per_gpu", "kv_elements_per_token", "kv_bytes_per_token"):
        monkeypatch.setattr(sizing, name, borrowed)
    ex.kv_bytes_per_token_per_gpu(80, 8, 128, 2, 16)


# ---- a sliding window: at most the window's tokens per layer -----------------------------------

MISTRAL_PER_TOKEN = 131_072  # 2 x 32 layers x 8 KV heads x 128 x 2 B (bf16)


def check_window(ex, seq_len, window, expected, note):
    what = call("sliding_window_kv_bytes", seq_len=seq_len, bytes_per_token=MISTRAL_PER_TOKEN,
                sliding_window=window)
    got = ex.sliding_window_kv_bytes(seq_len, MISTRAL_PER_TOKEN, window)
    hint = ""
    if window is not None and got == window * MISTRAL_PER_TOKEN and seq_len < window:
        hint = " -- a request shorter than the window holds only its own tokens"
    elif window is not None and got == seq_len * MISTRAL_PER_TOKEN and seq_len > window:
        hint = " -- every layer keeps only the last sliding_window tokens"
    try:
        assert_equal(got, expected, f"{what} [{note}]")
    except AssertionError as error:
        raise AssertionError(f"{error}{hint}") from None


def test_sliding_window_mistral_paper(ex):
    # Mistral 7B (Jiang et al., 2023, section 2): a 4,096-token window, 8x less cache at 32k tokens.
    check_window(ex, 32_768, 4096, 4096 * MISTRAL_PER_TOKEN,
                 "mistral-7b v0.1 at 32k tokens: 512 MiB")
    full = sizing.size_report(PRESETS["mistral-7b"], seq_len=32_768).kv_cache_bytes
    windowed = ex.sliding_window_kv_bytes(32_768, MISTRAL_PER_TOKEN, 4096)
    assert_equal(full // windowed if windowed else None, 8,
                 "the 32k-token request's cache without a window / with it (kvlab.sizing's "
                 "4 GiB over yours) [the Mistral paper's 8x]")


@pytest.mark.parametrize("seq_len, expected, note", [
    (1, MISTRAL_PER_TOKEN, "1 token"),
    (1000, 1000 * MISTRAL_PER_TOKEN, "shorter than the window: all its tokens"),
    (4096, 4096 * MISTRAL_PER_TOKEN, "exactly the window"),
    (4097, 4096 * MISTRAL_PER_TOKEN, "one past the window: the oldest token dropped"),
    (131_072, 4096 * MISTRAL_PER_TOKEN, "128k tokens: still the window's 4,096"),
], ids=["1", "1000", "4096", "4097", "131072"])
def test_sliding_window_by_hand(ex, seq_len, expected, note):
    check_window(ex, seq_len, 4096, expected, note)


@pytest.mark.parametrize("seq_len", [1, 4097, 32_768])
def test_no_window_keeps_every_token(ex, seq_len):
    expected = sizing.size_report(PRESETS["mistral-7b"], seq_len=seq_len).kv_cache_bytes
    check_window(ex, seq_len, None, expected, "sliding_window None: as kvlab.sizing.size_report")


# ---- a latent cache: one compressed vector and one RoPE key a token a layer --------------------

def check_mla(ex, layers, rank, rope, dtype_bytes, expected, note):
    what = call("mla_kv_bytes_per_token", num_hidden_layers=layers, kv_lora_rank=rank,
                qk_rope_head_dim=rope, dtype_bytes=dtype_bytes)
    got = ex.mla_kv_bytes_per_token(layers, rank, rope, dtype_bytes)
    hint = ""
    if got == 2 * expected:
        hint = (" -- twice the answer: MLA caches no separate K and V; one latent rebuilds both")
    elif got == layers * rank * dtype_bytes:
        hint = " -- the decoupled RoPE key (qk_rope_head_dim numbers) is cached too"
    try:
        assert_equal(got, expected, f"{what} [{note}]")
    except AssertionError as error:
        raise AssertionError(f"{error}{hint}") from None


@pytest.mark.parametrize("layers, dtype_bytes, expected, note", [
    (60, 2, 69_120, "deepseek-v2 in bf16: 67.5 KiB"),
    (61, 2, 70_272, "deepseek-v3 in bf16"),
    (27, 2, 31_104, "deepseek-v2-lite in bf16"),
    (61, 1, 35_136, "deepseek-v3 with an fp8 cache"),
], ids=["v2", "v3", "v2-lite", "v3-fp8"])
def test_mla_published_configs(ex, layers, dtype_bytes, expected, note):
    check_mla(ex, layers, 512, 64, dtype_bytes, expected, note)


def test_mla_matches_the_papers_table_1(ex):
    # DeepSeek-V2, table 1: (d_c + d_h^R) l elements a token, d_c = 4 d_h and d_h^R = d_h / 2, so
    # 9/2 d_h l. With d_h = 128 and l = 60 layers, in fp32 (4 B) this time.
    check_mla(ex, 60, 4 * 128, 128 // 2, 4, 9 * 128 * 60 // 2 * 4,
              "the paper's (d_c + d_h^R) x l elements, d_h = 128, fp32")
    # The same model cached as MHA (128 heads of 128 for K and V) would be 56.9x larger.
    mha = sizing.kv_bytes_per_token(PRESETS["llama-2-7b"].with_changes(
        num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128), "bf16")
    mla = ex.mla_kv_bytes_per_token(60, 512, 64, 2)
    assert_equal(mha * 10 // mla if mla else None, 568,
                 "10 x deepseek-v2's cache per token as MHA (kvlab.sizing, 3,932,160 B) // yours "
                 "[MLA stores 56.9x less]")
