"""The machine the course runs on: which device and dtype, what it is, and how fast it copies.

bfloat16 needs an Ampere-class GPU or newer (compute capability >= 8.0). A T4 (Colab's free GPU,
compute capability 7.5) has no bf16 units, so the course uses float16 there; on the CPU it uses
float32, which is what the stored notebook outputs were computed in.

Every measured figure is reported with the machine it came from (`describe_environment`, one record
for the GPU tour's environment stage and stage 5's benchmark alike), and a memory-bound kernel is
judged against the copy bandwidth measured in the same run (`copy_bandwidth_gb_s`), never a
datasheet: bytes read + bytes written by one large device-to-device copy, over its median time.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import subprocess
from time import perf_counter

import torch

__all__ = ["card_name", "card_slug", "copy_bandwidth_gb_s", "default_device", "default_dtype",
           "describe_environment"]

# bf16 tensor-core arithmetic arrived with Ampere (sm_80: A100, then A10G, L4, H100, ...).
BF16_MIN_CAPABILITY = (8, 0)
# The copy a GPU's bandwidth is measured with: 2 GiB, so launch overhead is noise and no L2 cache
# holds it (H100/H200: 50/60 MiB).
GPU_COPY_BYTES = 1 << 31


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


def copy_bandwidth_gb_s(device: torch.device | str, num_bytes: int, repeats: int = 20) -> float:
    """GB/s (1e9 B/s) of `dst.copy_(src)` over num_bytes, counting read + write (2 x num_bytes).

    The median over `repeats` copies after one warm-up copy (first-touch page faults, lazy CUDA
    init); on CUDA each copy is timed with CUDA events, on a CPU with perf_counter.

    Raises:
        ValueError: num_bytes or repeats below 1.
    """
    if num_bytes < 1 or repeats < 1:
        raise ValueError(f"copy bandwidth needs num_bytes >= 1 and repeats >= 1, "
                         f"got num_bytes={num_bytes}, repeats={repeats}")
    device = torch.device(device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times_s = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
        else:
            begin = perf_counter()
            dst.copy_(src)
            times_s.append(perf_counter() - begin)
    del src, dst
    return 2 * num_bytes / statistics.median(times_s) / 1e9


def card_name(device: torch.device | str) -> str:
    """The GPU's name, or on a CPU the processor's (its architecture where the platform says no
    more, "cpu" where it says nothing)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def card_slug(device: torch.device | str) -> str:
    """`card_name` as a folder name (each run of non-alphanumerics a dash): results/<card>/."""
    return "".join(c if c.isalnum() else "-" for c in card_name(device)).strip("-")


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi (None when the tool is absent or fails)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() \
        else None


def _version(module: str) -> str | None:
    """module.__version__, or None when it does not import (stages 0-4 run without Triton)."""
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None


def describe_environment(device: torch.device | str, mode: str,
                         copy_bytes: int | None = None) -> dict:
    """The machine behind a run's figures, as one JSON-ready record.

    Keys: date (UTC), mode (as given), device, card (`card_name`), dtype (`default_dtype`),
    python, torch, triton, numpy (None when one does not import), cuda (torch's CUDA build),
    cpu (model), cpu_count, triton_interpret; on CUDA also total_memory_bytes
    (`torch.cuda.get_device_properties`), free_bytes / total_bytes (`torch.cuda.mem_get_info`),
    compute_capability, multiprocessors and driver (nvidia-smi); with copy_bytes, also copy_bytes
    and copy_gb_s (`copy_bandwidth_gb_s`, measured now).
    """
    device = torch.device(device)
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        mode=mode, device=str(device), card=card_name(device),
        dtype=str(default_dtype(device)).replace("torch.", ""),
        python=platform.python_version(), torch=torch.__version__, triton=_version("triton"),
        numpy=_version("numpy"), cuda=torch.version.cuda, cpu=_cpu_model(),
        cpu_count=os.cpu_count(), triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(total_memory_bytes=props.total_memory, free_bytes=free, total_bytes=total,
                    compute_capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, driver=_driver_version())
    if copy_bytes is not None:
        info.update(copy_bytes=copy_bytes, copy_gb_s=copy_bandwidth_gb_s(device, copy_bytes))
    return info
