"""Which device and dtype the course computes in.

bfloat16 needs an Ampere-class GPU or newer (compute capability >= 8.0). A T4 (Colab's free GPU,
compute capability 7.5) has no bf16 units, so the course uses float16 there; on the CPU it uses
float32, which is what the stored notebook outputs were computed in.

What the machine is and how fast it copies (the record every measured figure is reported with) is
measurement tooling, beside the course: `kvlab.tools.machine`.
"""

from __future__ import annotations

import torch

__all__ = ["default_device", "default_dtype"]

# bf16 tensor-core arithmetic arrived with Ampere (sm_80: A100, then A10G, L4, H100, ...).
BF16_MIN_CAPABILITY = (8, 0)


def default_device() -> torch.device:
    """cuda:0 if a CUDA GPU is visible, else cpu."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The dtype the course computes in on `device` (default: `default_device()`).

    float32 on CPU; bfloat16 on CUDA GPUs of compute capability >= 8.0 (and on ROCm); float16 on
    older GPUs such as the T4 (sm_75). The capability is asked for directly:
    `torch.cuda.is_bf16_supported()` also answers True on a T4, because there bf16 tensors can be
    created and are emulated, which is slower than float16.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return torch.float32
    if torch.version.hip:
        return torch.bfloat16
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    return torch.bfloat16 if tuple(capability) >= BF16_MIN_CAPABILITY else torch.float16
