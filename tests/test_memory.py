"""kvlab.memory: on CPU every figure is an exact byte count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlab.checkpoint import load_model
from kvlab.contiguous import ContiguousKVCache
from kvlab.memory import AccountedCache, MemoryReport, device_name, measure, tensor_bytes
from kvlab.paged import PagedKVCache


@dataclasses.dataclass
class FakeCache:
    """Exactly the attributes the protocol declares, nothing more."""

    reserved_bytes: int
    used_bytes: int
    allocated_bytes: int = 0
    num_tensors: int = 2
    allocator_delta_bytes: int | None = None


def test_protocol_declares_what_both_caches_provide(tiny_model):
    declared = set(AccountedCache.__annotations__)
    assert declared == {"reserved_bytes", "used_bytes", "allocated_bytes", "num_tensors",
                        "allocator_delta_bytes"}
    assert declared == {field.name for field in dataclasses.fields(FakeCache)}
    contiguous = ContiguousKVCache(tiny_model.config, max_num_seqs=2, max_model_len=4)
    paged = PagedKVCache(tiny_model.config, num_blocks=3, block_size=4)
    for cache in (contiguous, paged):
        for name in declared:
            assert hasattr(cache, name), f"{type(cache).__name__} lacks {name}"
    assert contiguous.allocated_bytes == contiguous.reserved_bytes
    assert paged.allocated_bytes == paged.pool_bytes == tensor_bytes(paged.k_caches + paged.v_caches)


def test_weights_are_the_sum_of_parameter_bytes(hf_checkpoint):
    model = load_model(hf_checkpoint.path)
    hf_params = list(hf_checkpoint.hf_model.parameters())
    # By hand: embed 128x64 + lm_head 64x128 + 2 layers x (q 64x64, k 16x64, v 16x64, o 64x64,
    # gate/up/down 3 x 64x96, two norms 64) + final norm 64, all fp32.
    by_hand = 4 * (2 * 128 * 64 + 2 * (64 * 64 * 2 + 16 * 64 * 2 + 3 * 64 * 96 + 2 * 64) + 64)
    report = measure(model)
    assert report.weights_bytes == by_hand == sum(p.numel() * 4 for p in hf_params)
    assert report.device == "cpu"
    assert report.kv_reserved_bytes == report.kv_used_bytes == 0
    assert report.waste == 0.0
    assert report.peak_allocated_bytes is None and report.allocator_kv_bytes is None


def test_tied_weights_counted_once(hf_tied_checkpoint, hf_checkpoint):
    tied, untied = load_model(hf_tied_checkpoint.path), load_model(hf_checkpoint.path)
    assert measure(untied).weights_bytes - measure(tied).weights_bytes == 128 * 64 * 4
    assert measure(tied).weights_bytes == sum(
        p.numel() * 4 for p in hf_tied_checkpoint.hf_model.parameters())


def test_bf16_weights_are_half(hf_checkpoint):
    fp32 = measure(load_model(hf_checkpoint.path)).weights_bytes
    assert measure(load_model(hf_checkpoint.path, dtype=torch.bfloat16)).weights_bytes * 2 == fp32


def test_cache_reserved_used_and_waste(tiny_model):
    cache = ContiguousKVCache(tiny_model.config, max_num_seqs=4, max_model_len=10)
    per_token = 2 * 2 * 2 * 8 * 4  # 256 B
    slab = cache.add_sequence()
    with torch.no_grad():
        tiny_model(torch.tensor([5, 6, 7]), torch.arange(3), cache.view(slab))
    report = measure(tiny_model, cache)
    assert report.kv_reserved_bytes == 4 * 10 * per_token == 10_240
    assert report.kv_reserved_bytes == tensor_bytes([cache.k, cache.v])
    assert report.kv_used_bytes == 3 * per_token == 768
    assert report.waste == pytest.approx(1 - 768 / 10_240)  # 92.5 %
    assert report.weights_bytes == tiny_model.weights_bytes


def test_measure_any_accounted_cache_without_model():
    report = measure(cache=FakeCache(reserved_bytes=1000, used_bytes=250))
    assert report.device == "cpu" and report.weights_bytes == 0
    assert report.waste == pytest.approx(0.75)
    text = str(report)
    assert "1,000 B" in text and "250 B" in text and "75.0%" in text


def test_empty_report():
    report = measure()
    assert (report.weights_bytes, report.kv_reserved_bytes, report.kv_used_bytes) == (0, 0, 0)
    assert report.waste == 0.0


def test_rows_show_exact_and_binary_units():
    report = MemoryReport("cpu", 3 * 2**20, 2**30, 2**28)
    rows = dict(report.rows())
    assert rows["weights"] == "3,145,728 B (3 MiB)"
    assert rows["KV reserved"] == "1,073,741,824 B (1 GiB)"
    assert rows["KV used (holding tokens)"] == "268,435,456 B (256 MiB)"
    assert rows["KV waste"] == "75.0%"
    assert "KV per CUDA allocator" not in rows  # CPU: no allocator figures


def test_tensor_bytes_and_device_name():
    tensors = [torch.zeros(3, 5), torch.zeros(7, dtype=torch.float16), torch.zeros(2, 2,
                                                                                  dtype=torch.int8)]
    assert tensor_bytes(tensors) == 60 + 14 + 4
    assert device_name("cpu") == "cpu"


# ---- the device's own figures, and the allocator cross-check --------------------------------------

def test_cpu_report_reads_the_process_resident_memory():
    report = measure(cache=FakeCache(reserved_bytes=1000, used_bytes=250))
    assert report.resident_bytes is not None and report.resident_bytes > 10 * 2**20  # torch alone
    assert report.allocated_bytes is None and report.free_bytes is None  # no CUDA figures
    rows = dict(report.rows())
    assert rows["process resident memory (CPU)"].endswith(")")


def test_a_disagreeing_allocator_figure_is_refused_on_the_cpu_too():
    """The cross-check needs no GPU: a cache whose recorded allocator growth disagrees with its
    tensor bytes is refused, with both figures; one that agrees (allowing rounding) is reported."""
    agrees = FakeCache(reserved_bytes=4096, used_bytes=0, allocated_bytes=4096, num_tensors=2,
                       allocator_delta_bytes=4096 + 512)  # rounded up to the allocator's blocks
    assert measure(cache=agrees).allocator_kv_bytes == 4096 + 512
    for delta in (4096 - 1, 4096 + 2 * (2**20 + 512) + 1):  # below the bytes; past the slack
        with pytest.raises(RuntimeError, match=rf"saw {delta:,} B .* 2 tensors hold 4,096 B"):
            measure(cache=FakeCache(reserved_bytes=4096, used_bytes=0, allocated_bytes=4096,
                                    num_tensors=2, allocator_delta_bytes=delta))


def test_cuda_report_reads_the_allocator(monkeypatch):
    """On CUDA the same report carries torch.cuda's figures (faked here: no GPU on CI)."""
    figures = {"memory_allocated": 3 * 2**30, "memory_reserved": 4 * 2**30,
               "max_memory_allocated": 5 * 2**30}
    for name, value in figures.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    report = measure(cache=FakeCache(reserved_bytes=2**30, used_bytes=2**29), device="cuda:0")
    assert (report.allocated_bytes, report.allocator_reserved_bytes, report.peak_allocated_bytes,
            report.free_bytes, report.total_bytes) == (3 * 2**30, 4 * 2**30, 5 * 2**30,
                                                       70 * 2**30, 80 * 2**30)
    assert report.resident_bytes is None
    rows = dict(report.rows())
    assert rows["device"] == "NVIDIA H100 80GB HBM3"
    assert rows["reserved by the allocator (CUDA)"] == "4,294,967,296 B (4 GiB)"
    assert rows["device total (CUDA)"] == "85,899,345,920 B (80 GiB)"
