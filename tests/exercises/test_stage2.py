"""Stage 2: the contiguous cache's start-up check, writes and accounting vs `kvlab.contiguous`.

Grades `stage2_contiguous_cache.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 2`.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import sizing
from kvlab.config import PRESETS, LlamaConfig
from kvlab.contiguous import ContiguousKVCache, KVCacheOutOfMemory, reservation_bytes
from kvlab.tools.grading import assert_close, assert_equal, expect_raises

GiB = 2**30


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage2_contiguous_cache.py")


def tiny_config(layers=1, kv_heads=2, head_dim=4, heads=None):
    return LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                       num_hidden_layers=layers, num_attention_heads=heads or kv_heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim)


def fill(cache, slab, num_tokens, seed=0):
    """Run one prefill of `num_tokens` through kvlab's own cache (every layer), as a model would."""
    config = cache.config
    generator = torch.Generator().manual_seed(seed)
    shape = (num_tokens, config.num_key_value_heads, config.head_dim)
    positions = torch.arange(num_tokens)
    store = cache.view(slab)
    for layer in range(config.num_hidden_layers):
        key, value = (torch.randn(shape, generator=generator).to(cache.dtype) for _ in range(2))
        store.attend(layer, key.clone(), key, value, positions)


# ---- check_reservation ------------------------------------------------------------------------

def test_check_reservation_fits(ex):
    config = PRESETS["llama-3.1-8b"]
    per_token = sizing.kv_bytes_per_token(config)
    expected = reservation_bytes(config, 8, 1024, 2)
    assert_equal(ex.check_reservation(8, 1024, per_token, 40 * GiB), expected,
                 f"check_reservation(max_num_seqs=8, max_model_len=1024, bytes_per_token="
                 f"{per_token}, budget_bytes=40 GiB) [as kvlab.contiguous.reservation_bytes]")


def test_check_reservation_exactly_the_budget_fits(ex):
    assert_equal(ex.check_reservation(4, 100, 10, 4000), 4000,
                 "check_reservation(max_num_seqs=4, max_model_len=100, bytes_per_token=10, "
                 "budget_bytes=4000) [a reservation equal to the budget fits]")


def test_check_reservation_refuses_with_the_formula(ex):
    per_token = sizing.kv_bytes_per_token(PRESETS["llama-3.1-8b"])  # 131,072 B = 128 KiB
    what = (f"check_reservation(max_num_seqs=128, max_model_len=4096, bytes_per_token="
            f"{per_token}, budget_bytes=40 GiB) [needs 64 GiB]")
    error = expect_raises(MemoryError, lambda: ex.check_reservation(128, 4096, per_token,
                                                                     40 * GiB), what)
    message = str(error)
    wanted = 128 * 4096 * per_token

    def shown(number):
        return any(text in message for text in
                   (str(number), f"{number:,}", sizing.format_bytes(number)))

    missing = [label for label, ok in (
        ("'128 seqs x 4096 tokens'", "128 seqs x 4096 tokens" in message),
        (f"the bytes per token ({sizing.format_bytes(per_token)})", shown(per_token)),
        (f"the total ({sizing.format_bytes(wanted)})", shown(wanted)),
        (f"the budget ({sizing.format_bytes(40 * GiB)})", shown(40 * GiB))) if not ok]
    assert not missing, (f"{what}: the MemoryError message should show the arithmetic, e.g. "
                         f"'KV cache reservation 128 seqs x 4096 tokens x 128 KiB/token = 64 GiB "
                         f"> 40 GiB budget'; it lacks {', '.join(missing)}. Got: {message!r}")


@pytest.mark.parametrize("max_num_seqs, max_model_len, budget", [
    (4, 32, 16 * 1024), (4, 32, 16 * 1024 - 1), (1, 1, 10**9), (16, 64, 100_000)])
def test_check_reservation_agrees_with_kvlab(ex, max_num_seqs, max_model_len, budget):
    config = tiny_config(layers=2, kv_heads=2, head_dim=4)  # 128 B per token in fp32
    per_token = reservation_bytes(config, 1, 1, 4)
    what = (f"check_reservation(max_num_seqs={max_num_seqs}, max_model_len={max_model_len}, "
            f"bytes_per_token={per_token}, budget_bytes={budget})")
    try:
        cache = ContiguousKVCache(config, max_num_seqs, max_model_len, budget_bytes=budget)
    except KVCacheOutOfMemory:
        expect_raises(MemoryError, lambda: ex.check_reservation(max_num_seqs, max_model_len,
                                                                per_token, budget),
                      what + " [kvlab.contiguous refuses this reservation]")
    else:
        assert_equal(ex.check_reservation(max_num_seqs, max_model_len, per_token, budget),
                     cache.reserved_bytes, what + " [kvlab.contiguous reserves it]")


@pytest.mark.parametrize("max_num_seqs, max_model_len", [(0, 4096), (8, 0)])
def test_check_reservation_rejects_empty(ex, max_num_seqs, max_model_len):
    expect_raises(ValueError, lambda: ex.check_reservation(max_num_seqs, max_model_len, 10, 10**9),
                  f"check_reservation(max_num_seqs={max_num_seqs}, max_model_len={max_model_len}, "
                  f"bytes_per_token=10, budget_bytes=10**9)")


# ---- write_kv ---------------------------------------------------------------------------------

def test_write_kv_prefill_then_decode_matches_kvlab(ex):
    config = tiny_config(layers=1, kv_heads=2, head_dim=4)
    cache = ContiguousKVCache(config, max_num_seqs=2, max_model_len=10)
    cache.add_sequence()
    slab = cache.add_sequence()  # use slab 1, so a write to the wrong row would show
    store = cache.view(slab)
    mine = torch.zeros(10, 2, 4)
    generator = torch.Generator().manual_seed(0)
    steps = [torch.arange(6), torch.tensor([6]), torch.tensor([7])]  # prefill 6, decode 2
    for positions in steps:
        k = torch.randn(len(positions), 2, 4, generator=generator)
        store.attend(0, k.clone(), k, k.clone(), positions)
        ex.write_kv(mine, positions, k)
        assert_close(mine, cache.k[0, slab],
                     f"write_kv(slab [10, 2, 4], positions={positions.tolist()}, k "
                     f"[{len(positions)}, 2, 4]): the slab after the write vs "
                     f"kvlab.contiguous (slab row p must hold token p)", atol=0, rtol=0)


def test_write_kv_out_of_order_positions(ex):
    slab = torch.zeros(8, 1, 2)
    positions = torch.tensor([5, 1, 3])
    k = torch.tensor([[[5.0, 5.5]], [[1.0, 1.5]], [[3.0, 3.5]]])
    ex.write_kv(slab, positions, k)
    expected = torch.zeros(8, 1, 2)
    expected[5], expected[1], expected[3] = k[0], k[1], k[2]
    assert_close(slab, expected, "write_kv(slab [8, 1, 2], positions=[5, 1, 3], k [3, 1, 2]): "
                 "the slab after the write", atol=0, rtol=0)


def test_write_kv_past_max_model_len_raises_and_writes_nothing(ex):
    slab = torch.zeros(4, 1, 2)
    positions = torch.tensor([3, 4])
    k = torch.ones(2, 1, 2)
    what = "write_kv(slab [4, 1, 2] (max_model_len=4), positions=[3, 4], k [2, 1, 2])"
    expect_raises(MemoryError, lambda: ex.write_kv(slab, positions, k), what)
    assert_close(slab, torch.zeros(4, 1, 2), what + ": the slab after the refused write "
                 "(nothing may be written)", atol=0, rtol=0)


# ---- reserved_bytes, used_bytes, waste --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reserved_bytes_matches_kvlab(ex, dtype):
    cache = ContiguousKVCache(tiny_config(layers=2, kv_heads=2, head_dim=4), max_num_seqs=3,
                              max_model_len=16, dtype=dtype)
    assert_equal(ex.reserved_bytes(cache.k, cache.v), cache.reserved_bytes,
                 f"reserved_bytes(cache.k {list(cache.k.shape)}, cache.v {list(cache.v.shape)}, "
                 f"{str(dtype).replace('torch.', '')}) [as ContiguousKVCache.reserved_bytes]")


# Tokens (prompt + generated) of 8 requests in a 4,096-token-slab server: long-tailed, mean ~960,
# in the range of the Azure 2023 conversation trace (context mean 1,155, generated mean 211).
TRAFFIC = [1366, 400, 2100, 250, 900, 1200, 700, 800]


def test_used_bytes_and_waste_on_traffic_match_kvlab(ex):
    config = tiny_config(layers=1, kv_heads=1, head_dim=2)  # 16 B per token in fp32
    cache = ContiguousKVCache(config, max_num_seqs=len(TRAFFIC), max_model_len=4096)
    for seed, num_tokens in enumerate(TRAFFIC):
        fill(cache, cache.add_sequence(), num_tokens, seed)
    used = ex.used_bytes(cache.seq_lens, cache.bytes_per_token)
    assert_equal(used, cache.used_bytes,
                 f"used_bytes(seq_lens={cache.seq_lens}, bytes_per_token={cache.bytes_per_token}) "
                 f"[as ContiguousKVCache.used_bytes]")
    expected = 1 - cache.used_bytes / cache.reserved_bytes
    got = ex.waste(cache.used_bytes, cache.reserved_bytes)
    what = f"waste(used={cache.used_bytes:,}, reserved={cache.reserved_bytes:,})"
    assert isinstance(got, float) and abs(got - expected) < 1e-12, (
        f"{what}: expected {expected:.6f}, got {got!r}")
    # The vLLM paper's finding, reproduced: 60-80 % of the reservation holds nothing.
    assert 0.6 <= got <= 0.8, f"{what}: expected 60-80 % wasted on this traffic, got {got:.1%}"


def test_used_bytes_free_slabs_hold_nothing(ex):
    assert_equal(ex.used_bytes([0, 0, 0], 131_072), 0,
                 "used_bytes(seq_lens=[0, 0, 0], bytes_per_token=131072)")


@pytest.mark.parametrize("used, reserved, expected", [
    (0, 1000, 1.0), (1000, 1000, 0.0), (200, 4096, 1 - 200 / 4096)])
def test_waste_values(ex, used, reserved, expected):
    got = ex.waste(used, reserved)
    assert isinstance(got, float) and abs(got - expected) < 1e-12, (
        f"waste(used={used}, reserved={reserved}): expected {expected:.6f}, got {got!r}")


@pytest.mark.parametrize("used, reserved", [(0, 0), (10, -5), (2000, 1000), (-1, 1000)])
def test_waste_rejects_impossible_inputs(ex, used, reserved):
    expect_raises(ValueError, lambda: ex.waste(used, reserved),
                  f"waste(used={used}, reserved={reserved})")
