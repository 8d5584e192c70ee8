"""The attention-backend seam: the paged cache calls whatever backend it is given, for every layer."""

from __future__ import annotations

import collections

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.generate import generate
from kvlab.model import LlamaForCausalLM
from kvlab.paged import BACKENDS, PagedKVCache, TorchBackend, resolve_backend

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=128, name="tiny")


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
        assert args[-1] == pytest.approx(CONFIG.head_dim ** -0.5)
        self.calls["prefill"] += 1
        return super().prefill(*args)

    def decode(self, *args):
        assert args[-1] == pytest.approx(CONFIG.head_dim ** -0.5)
        self.calls["decode"] += 1
        return super().decode(*args)


def test_generation_goes_through_the_given_backend():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    backend = RecordingBackend()
    result = generate(model, [5, 9, 3], 4, cache="paged", block_size=4, attention_backend=backend)
    assert result.cache.backend is backend
    assert result.token_ids == generate(model, [5, 9, 3], 4, cache="none").token_ids
    layers = CONFIG.num_hidden_layers  # 1 prefill + 3 decode steps, each in every layer
    assert backend.calls == {"prefill": layers, "decode": 3 * layers, "write_kv": 4 * layers}


def test_resolve_backend():
    assert isinstance(resolve_backend(None), TorchBackend)
    assert isinstance(resolve_backend("torch"), TorchBackend)
    assert "torch" in BACKENDS
    backend = RecordingBackend()
    assert resolve_backend(backend) is backend
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'; choose from torch"):
        resolve_backend("cuda")
    with pytest.raises(ValueError, match="has no write_kv, prefill, decode"):
        PagedKVCache(CONFIG, num_blocks=2, block_size=4, attention_backend=object())
