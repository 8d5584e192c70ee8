"""Stage `environment` of the GPU tour: what machine the figures come from.

    python -m kvlab.tools.tour.environment --out DIR [--dry-run]

Writes DIR/environment.json and DIR/environment.md. The record and the copy bandwidth are
`kvlab.tools.machine.describe_environment` and `copy_bandwidth_gb_s`, the same functions stage 5's
benchmark reports its machine with, so the two never disagree on what was measured or how.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..machine import GPU_COPY_BYTES, describe_environment

__all__ = ["tour_environment", "format_environment", "main"]

CPU_COPY_BYTES = 1 << 24   # 16 MiB for the dry run: it only shows the code runs


def tour_environment(dry_run: bool = False) -> dict:
    """`describe_environment` of the card (the CPU in a dry run, even where a GPU exists), with
    its copy bandwidth over GPU_COPY_BYTES (CPU_COPY_BYTES on the CPU)."""
    use_cuda = torch.cuda.is_available() and not dry_run
    mode = "dry run (CPU, toy sizes, Triton interpreter)" if dry_run else "GPU tour"
    return describe_environment(torch.device("cuda" if use_cuda else "cpu"), mode,
                                GPU_COPY_BYTES if use_cuda else CPU_COPY_BYTES)


def format_environment(info: dict) -> str:
    """The environment as a Markdown table (every value as measured or reported)."""
    gib = 2 ** 30
    rows = [("date", info["date"]), ("mode", info["mode"]), ("device", info["device"]),
            ("card", info["card"]), ("dtype the course computes in", info["dtype"])]
    if "total_memory_bytes" in info:
        rows += [("memory (torch.cuda.get_device_properties)",
                  f"{info['total_memory_bytes']:,} B ({info['total_memory_bytes'] / gib:.2f} GiB)"),
                 ("free / total (torch.cuda.mem_get_info)",
                  f"{info['free_bytes']:,} / {info['total_bytes']:,} B"),
                 ("compute capability", info["compute_capability"]),
                 ("multiprocessors", info["multiprocessors"]), ("driver", info["driver"]),
                 ("clocks (nvidia-smi)", info["clocks"])]
    rows += [("python / torch / triton / numpy / CUDA",
              f"{info['python']} / {info['torch']} / {info['triton']} / {info['numpy']} / "
              f"{info['cuda']}"),
             ("cpu", f"{info['cpu']} ({info['cpu_count']} logical cores)"),
             ("copy bandwidth (read + write, median)",
              f"{info['copy_gb_s']:,.1f} GB/s over {info['copy_bytes']:,} B"),
             ("read bandwidth (a sum, bytes read, median)", f"{info['read_gb_s']:,.1f} GB/s")]
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
    info = tour_environment(args.dry_run)
    (args.out / "environment.json").write_text(json.dumps(info, indent=2) + "\n")
    text = format_environment(info)
    (args.out / "environment.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
