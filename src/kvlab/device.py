"""Which device and dtype the course computes in.

bfloat16 tensor-core arithmetic needs compute capability >= 8.0 (Ampere: A100, then A10G, L4, H100,
...). A T4 (Colab's free GPU, sm_75) has none, so the course uses float16 there; on the CPU it uses
float32, which the stored notebook outputs were computed in. What the machine is and how fast it
copies (recorded with every measured figure) is measurement tooling: `kvlab.tools.machine`.
"""

from __future__ import annotations

import torch

__all__ = ["default_device", "default_dtype"]

BF16_MIN_CAPABILITY = (8, 0)


def default_device() -> torch.device:
    """cuda:0 if a CUDA GPU is visible, else cpu."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """float32 on CPU, bfloat16 on ROCm and compute capability >= 8.0, else float16 (`device`
    default: `default_device()`). The capability is asked for directly: on a T4
    `torch.cuda.is_bf16_supported()` says True too, as bf16 is emulated there (slower than fp16)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return torch.float32
    if torch.version.hip:
        return torch.bfloat16
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    return torch.bfloat16 if tuple(capability) >= BF16_MIN_CAPABILITY else torch.float16
