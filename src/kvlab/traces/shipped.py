"""The traces that ship with kvlab, by name, and the one place that turns a `--trace` into a file.

`kvlab report` and `kvlab serve` both resolve `--trace NAME_OR_PATH` here, so a name that is
neither shipped nor a file gets the same one-line error, listing the shipped names.
"""

from __future__ import annotations

from pathlib import Path

from .azure import azure_trace_path
from .mooncake import mooncake_trace_path

__all__ = ["SHIPPED_TRACES", "trace_file"]

SHIPPED_TRACES = {
    "azure-conv": lambda: azure_trace_path("conv"),
    "azure-code": lambda: azure_trace_path("code"),
    "mooncake-conversation": lambda: mooncake_trace_path("conversation"),
    "mooncake-synthetic": lambda: mooncake_trace_path("synthetic"),
}


def trace_file(trace: str | Path) -> Path:
    """The file of a shipped name or an existing path; FileNotFoundError lists the shipped names."""
    path = SHIPPED_TRACES[str(trace)]() if str(trace) in SHIPPED_TRACES else Path(trace)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file, and not a shipped trace ("
                                f"{', '.join(SHIPPED_TRACES)})")
    return path
