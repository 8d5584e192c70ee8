"""Read a request trace for `kvlab serve`, by shipped name or by file, in either real format.

Both readers reject a malformed line with `file:line` and the bad value. Requests longer than
max_model_len are *kept* here: the server rejects them on arrival and counts them.
"""

from __future__ import annotations

from pathlib import Path

from .azure import load_azure_trace
from .mooncake import load_mooncake_trace
from .shipped import SHIPPED_TRACES, trace_file
from ..workload import Request

__all__ = ["load_trace", "SHIPPED_TRACES"]


def load_trace(trace: str | Path, limit: int | None = None) -> list[Request]:
    """Requests of a shipped trace or a `.csv` (Azure) or `.jsonl` (Mooncake) file, at most `limit`.
    InputFileError from `trace_file` (no such file, a folder, an unknown extension);
    TraceFormatError for a malformed line (file:line: what)."""
    path = trace_file(trace)
    if path.suffix == ".csv":
        return load_azure_trace(path, limit)
    return load_mooncake_trace(path, limit=limit).requests
