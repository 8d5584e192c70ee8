"""Which device and dtype the course computes in: one place, read by every model, cache and
measurement (CPU or GPU alike), so a learner with a GPU computes on it everywhere.

The device is the first CUDA GPU when one is visible, else the CPU; `KVLAB_DEVICE=cpu` forces the
CPU on a GPU machine (`cuda` or `cuda:N` asks for a card and fails clearly without one). bfloat16 tensor-core arithmetic needs compute capability >= 8.0 (Ampere: A100, then A10G, L4, H100,
...). A T4 (Colab's free GPU, sm_75) has none, so the course uses float16 there; on the CPU it uses
float32, which the stored notebook outputs were computed in. What the machine is and how fast it
copies (recorded with every measured figure) is measurement tooling: `kvlab.tools.machine`.
"""

from __future__ import annotations

import os
import re

import torch

__all__ = ["DEVICE_VARIABLE", "default_device", "default_dtype", "resolve_device"]

BF16_MIN_CAPABILITY = (8, 0)
DEVICE_VARIABLE = "KVLAB_DEVICE"


def default_device() -> torch.device:
    """$KVLAB_DEVICE if set (cpu, cuda, cuda:N), else cuda:0 if a CUDA GPU is visible, else cpu.
    ValueError: any other value, or a CUDA device that is not there (the message says which)."""
    wanted = os.environ.get(DEVICE_VARIABLE, "").strip()
    if not wanted:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if wanted == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", wanted):
        raise ValueError(f"{DEVICE_VARIABLE}={wanted!r}: expected cpu, cuda or cuda:N (unset: the "
                         f"GPU when there is one, else the CPU)")
    device = torch.device(wanted if ":" in wanted else "cuda:0")
    if not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_VARIABLE}={wanted}: no CUDA device is visible here; unset it "
                         f"or set {DEVICE_VARIABLE}=cpu")
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"{DEVICE_VARIABLE}={wanted}: only {torch.cuda.device_count()} CUDA "
                         f"device(s) here (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`device` as a torch.device, or `default_device()` when None."""
    return default_device() if device is None else torch.device(device)


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
