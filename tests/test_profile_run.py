"""kvlab.profile_run: the peak a block of code allocates (the allocator's on CUDA, counted tensors on
the CPU) and vLLM's profile run, the activation peak of a forward pass of max_num_batched_tokens."""

import pytest
import torch

from kvlab.profile_run import activation_peak, track_peak

FLOAT = 4  # bytes


def test_a_freed_tensor_leaves_the_count_and_the_peak_is_the_most_alive_at_once():
    with torch.inference_mode(), track_peak("cpu") as peak:
        first = torch.ones(1000)          # 4,000 B alive
        del first                         # freed
        second = torch.ones(500)          # 2,000 B
        third = second * 2                # 2,000 B more: 4,000 B alive together
        del second, third
        kept = torch.ones(2000)           # 8,000 B: the peak
    assert peak.method == "tensors counted" and peak.device == "cpu"
    assert peak.bytes == 2000 * FLOAT
    assert kept.numel() == 2000


def test_views_and_writes_into_existing_memory_are_not_counted():
    weight = torch.ones(64, 64)  # made before the block: not the block's
    with torch.inference_mode(), track_peak("cpu") as peak:
        weight.t()                 # a view of memory that was there
        weight[0].add_(1.0)        # a write into it
        row = weight[3].clone()    # new memory: 64 floats
        row.view(8, 8)             # a view of the block's own tensor: counted once
    assert peak.bytes == 64 * FLOAT


def test_the_peak_counts_tensors_alive_together_not_all_ever_made():
    with torch.inference_mode(), track_peak("cpu") as peak:
        for _ in range(10):
            torch.ones(256) + 1.0   # each iteration frees the last: never more than two alive
    assert peak.bytes == 2 * 256 * FLOAT


def test_activation_peak_of_the_tiny_model_grows_with_the_tokens_and_repeats_exactly():
    from kvlab.checkpoint import load_model

    model = load_model("tiny", device="cpu")
    small, large = activation_peak(model, 16), activation_peak(model, 64)
    assert 0 < small.bytes < large.bytes
    assert activation_peak(model, 64).bytes == large.bytes  # counted, so exactly repeatable
    config = model.config
    # At least one [tokens, intermediate_size] float32 projection is alive at the peak.
    assert large.bytes > 64 * config.intermediate_size * FLOAT
    with pytest.raises(ValueError, match="num_tokens"):
        activation_peak(model, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        activation_peak(model, config.max_position_embeddings + 1)


def test_on_cuda_the_allocator_peak_above_the_start_is_read(monkeypatch):
    readings = iter([1_000, 5_000])  # memory_allocated at the start; the peak at the end
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(readings))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(readings))
    with track_peak("cuda:0") as peak:
        calls.append("block")
    assert calls == ["sync", "reset", "block", "sync"]
    assert (peak.device, peak.method, peak.bytes) == ("cuda:0", "CUDA allocator peak", 4_000)
