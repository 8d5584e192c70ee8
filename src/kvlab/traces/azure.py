"""The Azure LLM inference trace 2023: real request sizes from two production services.

Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024,
published one hour of requests to two Azure LLM services (Azure Public Dataset, CC BY 4.0): `conv`,
a chat service (19,366 requests), and `code`, code completion (8,819; long prompts, short outputs).
Both ship unchanged in `kvlab/traces/data/azure-llm-2023/` (attribution in its README and NOTICE),
a CSV row per request: `TIMESTAMP,ContextTokens,GeneratedTokens`, read from any file (a newer
release too) by `load_azure_trace`.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

from ..input_files import InputFileError, read_text
from ..workload import Request

__all__ = ["AZURE_TRACE_DIR", "AZURE_TRACES", "AZURE_ATTRIBUTION", "TraceFormatError",
           "azure_trace", "azure_trace_path", "load_azure_trace"]

AZURE_TRACE_DIR = Path(__file__).parent / "data" / "azure-llm-2023"
# service -> file name, as in the Azure Public Dataset.
AZURE_TRACES = {"conv": "AzureLLMInferenceTrace_conv.csv",
                "code": "AzureLLMInferenceTrace_code.csv"}
AZURE_ATTRIBUTION = ("Azure LLM inference trace 2023 (Azure Public Dataset, CC BY 4.0; Patel et al., "
                     "Splitwise, ISCA 2024)")

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
_EXPECTED = f"a CSV trace with header {HEADER} and one request per row"


class TraceFormatError(InputFileError):
    """A trace file that is not `TIMESTAMP,ContextTokens,GeneratedTokens` rows (names file and line)."""


def azure_trace_path(service: str = "conv") -> Path:
    """Path of a shipped trace file: service 'conv' or 'code'."""
    if service not in AZURE_TRACES:
        raise ValueError(f"unknown Azure trace {service!r}; shipped: {', '.join(AZURE_TRACES)}")
    return AZURE_TRACE_DIR / AZURE_TRACES[service]


def azure_trace(service: str = "conv", limit: int | None = None) -> list[Request]:
    """The shipped trace of a service as Requests, in arrival order. `azure_trace("conv")`: 19,366
    requests; the first has 374 prompt and 44 generated tokens."""
    return load_azure_trace(azure_trace_path(service), limit=limit)


def load_azure_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a trace in the Azure CSV format (columns in any order, extras ignored), in file order;
    arrival_s is seconds after the first row's timestamp when the timestamps parse, else 0.
    MissingInputFileError (a FileNotFoundError) or InputFileError for a missing, unreadable, empty,
    binary or non-UTF-8 file; TraceFormatError, starting with the path (and `:line`), for missing
    columns, no rows, a short row, or a count that is not an integer >= 1 (ContextTokens) or >= 0
    (GeneratedTokens)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of requests, got {limit}")
    text = read_text(path, _EXPECTED)
    reader = csv.DictReader(text.splitlines())
    needed = ("ContextTokens", "GeneratedTokens")
    columns = [name.strip() for name in reader.fieldnames or []]
    if not set(needed) <= set(columns):
        missing = ", ".join(name for name in needed if name not in columns)
        raise TraceFormatError(f"{path}:1: header lacks {missing}; expected {_EXPECTED}, "
                               f"got {','.join(columns)[:80]!r}")
    reader.fieldnames = columns
    requests: list[Request] = []
    first_time = None
    for row in reader:
        where = f"{path}:{reader.line_num}"
        if None in row.values():  # DictReader fills the fields a short row lacks with None
            fields = sum(value is not None for value in row.values())
            raise TraceFormatError(f"{where}: row has {fields} of the header's {len(columns)} "
                                   f"fields; expected {_EXPECTED}")
        prompt = _count(row, "ContextTokens", minimum=1, where=where)
        output = _count(row, "GeneratedTokens", minimum=0, where=where)
        arrival = 0.0
        stamp = (row.get("TIMESTAMP") or "").strip()
        try:  # the trace writes 7 fractional digits; Python parses 6
            when = datetime.fromisoformat(stamp[:26])
            first_time = first_time or when
            arrival = (when - first_time).total_seconds()
        except ValueError:
            pass
        requests.append(Request(prompt, output, arrival))
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise TraceFormatError(f"{path}: has a header but no requests; expected {_EXPECTED}")
    return requests


def _count(row: dict, column: str, minimum: int, where: str) -> int:
    raw = row[column]
    try:
        value = int(raw.strip())
    except ValueError:
        raise TraceFormatError(f"{where}: {column}={raw!r} is not an integer; expected a whole "
                               f"number of tokens >= {minimum}") from None
    if value < minimum:
        raise TraceFormatError(f"{where}: {column}={value}; expected a whole number of tokens "
                               f">= {minimum}")
    return value
