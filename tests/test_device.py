"""The dtype the course picks per device: fp16 on a T4 (sm_75), bf16 from Ampere on, fp32 on CPU.

No GPU exists on CI, so CUDA is mocked: what is pinned is the choice made from the capability the
card reports, including on a T4, where torch.cuda.is_bf16_supported() answers True (emulation).
"""

import pytest
import torch

from kvlab.device import default_device, default_dtype


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu((major, minor)): pretend one CUDA card of that compute capability is present."""

    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        # A T4 can create bf16 tensors, so torch says yes; the choice must not rely on it.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        monkeypatch.setattr(torch.version, "hip", None)

    return install


def test_cpu_computes_in_float32():
    assert default_dtype("cpu") is torch.float32
    assert default_dtype(torch.device("cpu")) is torch.float32


@pytest.mark.parametrize("capability, expected", [
    ((7, 5), torch.float16),   # T4 (Colab's free GPU): no bf16 units
    ((7, 0), torch.float16),   # V100
    ((8, 0), torch.bfloat16),  # A100
    ((8, 9), torch.bfloat16),  # L4, RTX 4090
    ((9, 0), torch.bfloat16),  # H100
])
def test_cuda_dtype_follows_compute_capability(fake_gpu, capability, expected):
    fake_gpu(capability)
    assert default_device() == torch.device("cuda:0")
    assert default_dtype() is expected
    assert default_dtype("cuda") is expected
    assert default_dtype("cuda:0") is expected


def test_the_capability_of_the_named_card_is_asked(fake_gpu, monkeypatch):
    fake_gpu((8, 0))
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index=None: asked.append(index) or (7, 5))
    assert default_dtype("cuda:1") is torch.float16
    assert asked == [1]


def test_rocm_gets_bfloat16(fake_gpu, monkeypatch):
    fake_gpu((9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert default_dtype("cuda") is torch.bfloat16
