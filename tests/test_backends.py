"""The attention-backend seam: the paged cache calls the backend it is given, in every layer."""

from __future__ import annotations

import collections

import pytest

from kvlab.generate import generate
from kvlab.paged import BACKENDS, PagedKVCache, TorchBackend, resolve_backend

SCALE = 8 ** -0.5  # 1 / sqrt(head_dim) of small_config


class RecordingBackend(TorchBackend):
    """The torch backend, counting its calls and checking the scale it is handed."""

    name = "recording"

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def write_kv(self, *args):
        self.calls["write_kv"] += 1
        return super().write_kv(*args)

    def prefill(self, *args):
        assert args[-1] == pytest.approx(SCALE)
        self.calls["prefill"] += 1
        return super().prefill(*args)

    def decode(self, *args):
        assert args[-1] == pytest.approx(SCALE)
        self.calls["decode"] += 1
        return super().decode(*args)


def test_generation_goes_through_the_given_backend(small_llama, small_config):
    backend = RecordingBackend()
    result = generate(small_llama, [5, 9, 3], 4, cache="paged", block_size=4,
                      attention_backend=backend)
    assert result.cache.backend is backend
    assert result.token_ids == generate(small_llama, [5, 9, 3], 4, cache="none").token_ids
    layers = small_config.num_hidden_layers  # 1 prefill + 3 decode steps, each in every layer
    assert backend.calls == {"prefill": layers, "decode": 3 * layers, "write_kv": 4 * layers}


def test_resolve_backend(small_config):
    assert isinstance(resolve_backend(None), TorchBackend)
    assert isinstance(resolve_backend("torch"), TorchBackend)
    assert "torch" in BACKENDS
    backend = RecordingBackend()
    assert resolve_backend(backend) is backend
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'; choose from torch"):
        resolve_backend("cuda")
    with pytest.raises(ValueError, match="has no write_kv, prefill, decode"):
        PagedKVCache(small_config, num_blocks=2, block_size=4, attention_backend=object())
