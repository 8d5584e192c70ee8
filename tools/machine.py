"""The machine behind a measured figure: what it is, and how fast it copies and reads.

Every measured figure is reported with the machine it came from (`describe_environment`, one record
for the GPU tour's environment stage and stage 5's benchmark alike, with the driver and clocks that
`nvidia-smi` reports), and a memory-bound kernel is judged against bandwidths measured in the same
run, never a datasheet alone:

* `copy_bandwidth_gb_s`: bytes read + bytes written by one large device-to-device copy, over its
  median time (what a kernel that reads and writes as much can hope for);
* `read_bandwidth_gb_s`: bytes read by one large sum, over its median time. A decode-attention
  kernel reads the cache and writes almost nothing, so this is its roof: DRAM serves reads
  alone faster than an even mix of reads and writes (no bus turnarounds).

The datasheet figure (`datasheet_bandwidth_gb_s`, the serving cost model's card presets) is printed
beside them: the peak no measurement reaches. The dtype the course computes in on a device is
`kvlab.device.default_dtype`.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from time import perf_counter

import torch

from kvlab.device import default_dtype

__all__ = ["card_name", "card_slug", "copy_bandwidth_gb_s", "read_bandwidth_gb_s",
           "datasheet_bandwidth_gb_s", "gpu_clocks", "describe_environment", "cpu_caches",
           "cpu_model", "GPU_COPY_BYTES"]

# The copy a GPU's bandwidth is measured with: 2 GiB, so launch overhead is noise and no L2 cache
# holds it (H100/H200: 50/60 MiB).
GPU_COPY_BYTES = 1 << 31
# The datasheet cards of `kvlab.gpus.CARDS` (the one home of those figures) by a
# pattern of `torch.cuda.get_device_name`. Other parts of the same chips (H100 PCIe or NVL, A100
# 80GB PCIe) have other bandwidths, so they are not matched.
_DATASHEET_CARDS = ((r"\bH200\b", "H200"), (r"H100 80GB HBM3|H100 SXM", "H100-80GB"),
                    (r"A100-SXM4-80GB", "A100-80GB"), (r"A100-(SXM4|PCIE)-40GB", "A100-40GB"),
                    (r"\bL4\b", "L4"), (r"\bMI300X\b", "MI300X"))
# What `gpu_clocks` asks nvidia-smi for, and the key each answer is stored under.
_CLOCK_FIELDS = (("clocks.sm", "sm_mhz"), ("clocks.mem", "memory_mhz"),
                 ("clocks.max.sm", "max_sm_mhz"), ("clocks.max.mem", "max_memory_mhz"),
                 ("pstate", "pstate"), ("power.draw", "power_w"),
                 ("temperature.gpu", "temperature_c"))


def _median_seconds(device: torch.device, operation, repeats: int) -> float:
    """Median seconds of operation() over `repeats` runs after one warm-up run (first-touch page
    faults, lazy CUDA init): CUDA events on a GPU, perf_counter on a CPU."""
    operation()
    times_s = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            operation()
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
        else:
            begin = perf_counter()
            operation()
            times_s.append(perf_counter() - begin)
    return statistics.median(times_s)


def _check_size(what: str, num_bytes: int, repeats: int) -> None:
    if num_bytes < 1 or repeats < 1:
        raise ValueError(f"{what} bandwidth needs num_bytes >= 1 and repeats >= 1, "
                         f"got num_bytes={num_bytes}, repeats={repeats}")


def copy_bandwidth_gb_s(device: torch.device | str, num_bytes: int, repeats: int = 20) -> float:
    """GB/s (1e9 B/s) of `dst.copy_(src)` over num_bytes, counting read + write (2 x num_bytes),
    over the median of `repeats` copies.

    Raises:
        ValueError: num_bytes or repeats below 1.
    """
    _check_size("copy", num_bytes, repeats)
    device = torch.device(device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(device, lambda: dst.copy_(src), repeats)
    del src, dst
    return 2 * num_bytes / seconds / 1e9


def read_bandwidth_gb_s(device: torch.device | str, num_bytes: int, repeats: int = 20) -> float:
    """GB/s (1e9 B/s) of `torch.sum` over num_bytes of float32 zeros (rounded up to whole
    floats), counting the bytes read (not the 4-byte result), over the median of `repeats` sums.

    Raises:
        ValueError: num_bytes or repeats below 1.
    """
    _check_size("read", num_bytes, repeats)
    device = torch.device(device)
    src = torch.zeros(-(-num_bytes // 4), dtype=torch.float32, device=device)  # no denormals
    seconds = _median_seconds(device, lambda: src.sum(), repeats)
    del src
    return 4 * -(-num_bytes // 4) / seconds / 1e9


def datasheet_bandwidth_gb_s(card: str) -> float | None:
    """The memory bandwidth on the datasheet of the card named `card` (as `card_name` gives it),
    GB/s, from `kvlab.gpus.CARDS`; None for a card it does not list."""
    from kvlab.gpus import CARDS

    preset = next((name for pattern, name in _DATASHEET_CARDS if re.search(pattern, card)), None)
    return None if preset is None else CARDS[preset].bandwidth_bytes_per_s / 1e9


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


def cpu_caches(root: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[str, tuple[int, int]]:
    """The data caches CPU 0 sees, as Linux's sysfs describes them: {"L1d" or "L2" or "L3":
    (bytes, how many logical CPUs share it)}; {} where sysfs does not say (macOS, Windows). A
    figure timed on the CPU depends on whether its bytes fit in these."""
    caches = {}
    for folder in sorted(Path(root).glob("index*")):
        try:
            kind, level, size, shared = (
                (folder / name).read_text().strip()
                for name in ("type", "level", "size", "shared_cpu_list"))
        except OSError:
            continue
        if kind == "Instruction" or not size.endswith("K"):
            continue
        cpus = sum(int(b) - int(a) + 1 if "-" in part else 1
                   for part in shared.split(",") for a, _, b in [part.partition("-")])
        caches[f"L{level}{'d' if kind == 'Data' else ''}"] = (int(size[:-1]) * 1024, cpus)
    return caches


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _nvidia_smi(fields: list[str], index: int = 0) -> list[str] | None:
    """nvidia-smi's answers for `fields` of GPU `index`, as strings in that order ("[N/A]" kept);
    None when the tool is absent, fails or answers something else."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "-i", str(index), f"--query-gpu={','.join(fields)}",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    values = [value.strip() for value in lines[0].split(",")] if lines else []
    return values if done.returncode == 0 and len(values) == len(fields) else None


def _number(text: str) -> float | str | None:
    """nvidia-smi's value as a number where it is one; None for "[N/A]" and the like."""
    if text.startswith("[") or text in ("N/A", ""):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def gpu_clocks(device: torch.device | str) -> dict | None:
    """The card's clocks now, as nvidia-smi reports them: sm_mhz, memory_mhz, max_sm_mhz,
    max_memory_mhz, pstate ("P0": full speed), power_w, temperature_c (None: not reported).
    None on a CPU or without nvidia-smi."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    values = _nvidia_smi([field for field, _ in _CLOCK_FIELDS], index)
    if values is None:
        return None
    return {key: _number(value) for (_, key), value in zip(_CLOCK_FIELDS, values)}


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
    compute_capability, multiprocessors, driver and clocks (nvidia-smi, `gpu_clocks`; None
    without it); with copy_bytes, also copy_bytes, copy_gb_s (`copy_bandwidth_gb_s`) and read_gb_s
    (`read_bandwidth_gb_s` over as many bytes), measured now.
    """
    device = torch.device(device)
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        mode=mode, device=str(device), card=card_name(device),
        dtype=str(default_dtype(device)).replace("torch.", ""),
        python=platform.python_version(), torch=torch.__version__, triton=_version("triton"),
        numpy=_version("numpy"), cuda=torch.version.cuda, cpu=cpu_model(),
        cpu_count=os.cpu_count(), triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver = _nvidia_smi(["driver_version"], index)
        info.update(total_memory_bytes=props.total_memory, free_bytes=free, total_bytes=total,
                    compute_capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count,
                    driver=driver[0] if driver else None, clocks=gpu_clocks(device))
    if copy_bytes is not None:
        info.update(copy_bytes=copy_bytes, copy_gb_s=copy_bandwidth_gb_s(device, copy_bytes),
                    read_gb_s=read_bandwidth_gb_s(device, copy_bytes))
    return info
