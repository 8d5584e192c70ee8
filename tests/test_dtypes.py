"""The one dtype vocabulary: names, torch dtypes and element sizes resolve to the same record."""

import subprocess
import sys

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.contiguous import ContiguousKVCache, reservation_bytes
from kvlab.dtypes import DTYPES, dtype_bytes, dtype_name, resolve_dtype, torch_dtype
from kvlab.paged import PagedKVCache, kv_block_bytes


@pytest.mark.parametrize("spelling, name, nbytes, tdtype", [
    ("bf16", "bf16", 2, torch.bfloat16), ("bfloat16", "bf16", 2, torch.bfloat16),
    ("BF16", "bf16", 2, torch.bfloat16), (torch.bfloat16, "bf16", 2, torch.bfloat16),
    ("fp16", "fp16", 2, torch.float16), ("float16", "fp16", 2, torch.float16),
    (torch.float16, "fp16", 2, torch.float16),
    ("fp32", "fp32", 4, torch.float32), (torch.float32, "fp32", 4, torch.float32), (4, "fp32", 4, torch.float32),
    ("fp8", "fp8", 1, torch.float8_e4m3fn), (torch.float8_e4m3fn, "fp8", 1, torch.float8_e4m3fn),
    (1, "fp8", 1, torch.float8_e4m3fn),
])
def test_every_spelling_resolves_to_one_record(spelling, name, nbytes, tdtype):
    assert dtype_name(spelling) == name
    assert dtype_bytes(spelling) == nbytes
    assert torch_dtype(spelling) is tdtype
    assert torch.empty((), dtype=tdtype).element_size() == nbytes


def test_records_agree_with_torch():
    for record in DTYPES:
        assert record.torch.itemsize == record.bytes
        assert resolve_dtype(record.torch) is record
        assert resolve_dtype(record) is record


def test_two_bytes_is_a_size_but_not_a_dtype():
    assert dtype_bytes(2) == 2
    with pytest.raises(ValueError, match="2 bytes could be bf16 or fp16"):
        resolve_dtype(2)


@pytest.mark.parametrize("bad", ["int8", "fp64", torch.float64, torch.int32, 3, 0, -2, True, None, 2.0])
def test_unknown_dtypes_are_refused_with_the_value(bad):
    with pytest.raises(ValueError, match="dtype|element size|bytes"):
        dtype_bytes(bad)


def test_caches_accept_any_spelling():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    for spelling in ("bf16", torch.bfloat16):
        assert PagedKVCache(cfg, num_blocks=2, block_size=4, dtype=spelling).k_caches[0].dtype is torch.bfloat16
        assert ContiguousKVCache(cfg, 1, 8, dtype=spelling).k.dtype is torch.bfloat16
    assert kv_block_bytes(cfg, 16, "bf16") == kv_block_bytes(cfg, 16, torch.bfloat16) == kv_block_bytes(cfg, 16, 2)
    assert reservation_bytes(cfg, 2, 8, "fp32") == reservation_bytes(cfg, 2, 8, 4)


def test_module_does_not_import_torch():
    code = "import sys, kvlab.dtypes as d; d.dtype_bytes('bf16'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
