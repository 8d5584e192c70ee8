"""Stage `environment` of the GPU tour: what machine the figures come from.

    python -m kvlab.tour.environment --out DIR [--dry-run]

Writes DIR/environment.json and DIR/environment.md. Needs only torch (Triton's version is read if
it imports). The copy bandwidth is measured here, the same way as stage 5's benchmark defines it:
bytes read + bytes written by one device-to-device copy, divided by its median time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

__all__ = ["copy_bandwidth_gb_s", "describe_environment", "format_environment", "main"]

GPU_COPY_BYTES = 1 << 30   # 1 GiB: large enough that launch overhead is noise on any card
CPU_COPY_BYTES = 1 << 24   # 16 MiB for the dry run: it only shows the code runs


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int, repeats: int = 20) -> float:
    """GB/s (1e9 B/s) of `dst.copy_(src)` for num_bytes, counting read + write (2 x num_bytes).

    On CUDA each copy is timed with CUDA events after a warm-up; on a CPU with perf_counter.
    Returns the median over `repeats` copies.
    """
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch page faults, lazy CUDA init
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
            begin = time.perf_counter()
            dst.copy_(src)
            times_s.append(time.perf_counter() - begin)
    del src, dst
    return 2 * num_bytes / statistics.median(times_s) / 1e9


def _driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi (None when the tool is absent)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def describe_environment(dry_run: bool = False) -> dict:
    """The machine as a JSON-ready dict: versions, and on CUDA the card's figures.

    Keys: date (UTC), mode, python, torch, triton (None if it does not import), cuda (torch's CUDA
    version), device, and for a GPU: card, total_memory_bytes (torch.cuda.get_device_properties),
    free_bytes / total_bytes (torch.cuda.mem_get_info), compute_capability, multiprocessors,
    driver; copy_gb_s and copy_bytes always.
    """
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - any import failure means "no usable Triton"
        triton_version = None
    use_cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda" if use_cuda else "cpu")
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        mode="dry run (CPU, toy sizes, Triton interpreter)" if dry_run else "GPU tour",
        python=platform.python_version(), torch=torch.__version__, triton=triton_version,
        cuda=torch.version.cuda, device=str(device), cpu_count=os.cpu_count(),
        triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
    )
    if use_cuda:
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(card=props.name, total_memory_bytes=props.total_memory, free_bytes=free,
                    total_bytes=total, compute_capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, driver=_driver_version())
    else:
        info.update(card=platform.processor() or platform.machine() or "cpu")
    copy_bytes = GPU_COPY_BYTES if use_cuda else CPU_COPY_BYTES
    info.update(copy_bytes=copy_bytes, copy_gb_s=copy_bandwidth_gb_s(device, copy_bytes))
    return info


def format_environment(info: dict) -> str:
    """The environment as a Markdown table (every value as measured or reported)."""
    gib = 2 ** 30
    rows = [("date", info["date"]), ("mode", info["mode"]), ("device", info["device"]),
            ("card", info["card"])]
    if "total_memory_bytes" in info:
        rows += [("memory (torch.cuda.get_device_properties)",
                  f"{info['total_memory_bytes']:,} B ({info['total_memory_bytes'] / gib:.2f} GiB)"),
                 ("free / total (torch.cuda.mem_get_info)",
                  f"{info['free_bytes']:,} / {info['total_bytes']:,} B"),
                 ("compute capability", info["compute_capability"]),
                 ("multiprocessors", info["multiprocessors"]), ("driver", info["driver"])]
    rows += [("python / torch / triton / CUDA",
              f"{info['python']} / {info['torch']} / {info['triton']} / {info['cuda']}"),
             ("copy bandwidth (read + write, median)",
              f"{info['copy_gb_s']:,.1f} GB/s over {info['copy_bytes']:,} B")]
    lines = ["# Environment", "", "| what | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    if info["device"] == "cpu":
        lines += ["", "Not measured on a GPU: these figures describe the CPU the dry run used."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info = describe_environment(args.dry_run)
    (args.out / "environment.json").write_text(json.dumps(info, indent=2) + "\n")
    text = format_environment(info)
    (args.out / "environment.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
