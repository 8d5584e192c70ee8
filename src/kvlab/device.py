"""Pick where the course runs: a CUDA GPU when there is one, else the CPU.

bfloat16 needs an Ampere-class GPU or newer (compute capability >= 8.0). A T4 (Colab's free GPU,
compute capability 7.5) has no bf16 units, so the course uses float16 there; on the CPU it uses
float32, which is what the stored notebook outputs were computed in.
"""

from __future__ import annotations

import torch

__all__ = ["default_device", "default_dtype"]


def default_device() -> torch.device:
    """cuda:0 if a CUDA GPU is visible, else cpu."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """float32 on CPU; bfloat16 on GPUs that support it; float16 on older GPUs such as the T4."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
