"""The traces that ship with kvlab, by name, and the one place that turns a `--trace` into a file.

Every command that takes a trace (`kvlab report`, `kvlab serve`, notebook 07's `load_trace`)
resolves `--trace NAME_OR_PATH` here, so one mistake gets one message wherever it is made: a name
that is neither shipped nor a file, a folder, a file of neither trace format.
"""

from __future__ import annotations

from pathlib import Path

from ..input_files import MissingInputFileError, input_file_error
from .azure import azure_trace_path
from .mooncake import mooncake_trace_path

__all__ = ["SHIPPED_TRACES", "TRACE_FORMATS", "trace_file"]

SHIPPED_TRACES = {
    "azure-conv": lambda: azure_trace_path("conv"),
    "azure-code": lambda: azure_trace_path("code"),
    "mooncake-conversation": lambda: mooncake_trace_path("conversation"),
    "mooncake-synthetic": lambda: mooncake_trace_path("synthetic"),
}


# A trace file's format, by its extension.
TRACE_FORMATS = {".csv": "Azure: TIMESTAMP,ContextTokens,GeneratedTokens",
                 ".jsonl": "Mooncake: one JSON request per line"}


def trace_file(trace: str | Path) -> Path:
    """The file of a shipped name, or a path to a file of a known format (`TRACE_FORMATS`).
    InputFileError (MissingInputFileError for a missing path): the message names the path, what is
    wrong and what a trace should be."""
    if str(trace) in SHIPPED_TRACES:
        return SHIPPED_TRACES[str(trace)]()
    path = Path(trace)
    expected = (f"a shipped trace ({', '.join(SHIPPED_TRACES)}) or a trace file: "
                + " or ".join(f"{suffix} ({name})" for suffix, name in TRACE_FORMATS.items()))
    if not path.exists():
        raise MissingInputFileError(f"{path}: no such file, and not a shipped trace; expected "
                                    f"{expected}")
    if path.is_dir():
        raise input_file_error(path, "is a folder, not a trace file", expected)
    if path.suffix not in TRACE_FORMATS:
        raise input_file_error(path, f"unknown trace format {path.suffix or '(no extension)'}",
                               expected)
    return path
