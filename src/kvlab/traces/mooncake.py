"""The Mooncake traces (Qin et al., USENIX FAST 2025): real requests with their prefix structure.

Each line of a trace is one request,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

timestamp in milliseconds since the trace began, lengths in tokens, and one id per 512-token block
of the prompt (the last may be partial: len(hash_ids) = ceil(input_length / 512)). The ids are
remapped hashes of the blocks *with their prefix*: equal ids at equal positions mean two prompts
share everything up to the end of that block. That is exactly a prefix cache's key, so the traces
measure prefix caching on real traffic without a token of text. A line becomes a
`kvlab.workload.Request` with its hash_ids as `trace_block_ids`; at a block size B that divides
512, sub-block j of block id h gets key h * (512 / B) + j (`block_keys`).

Two traces ship as package data (Apache-2.0; attribution in `data/mooncake/NOTICE.md`):
`conversation` (12,031 requests, one hour of a production chat service) and `synthetic` (3,993
multi-turn requests built from public datasets). Their prompts are long (mean ~12K and ~15K
tokens, some over 100K): `load_mooncake_trace(..., max_model_len=L)` keeps the requests with
input_length + output_length <= L and counts the others (`num_rejected`), as a server would.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..workload import Request
from .azure import TraceFormatError

__all__ = ["TRACE_BLOCK_SIZE", "MOONCAKE_TRACES", "MooncakeTrace", "load_mooncake_trace",
           "expand_hash_ids", "block_keys", "mooncake_trace_path", "TraceFormatError"]

TRACE_BLOCK_SIZE = 512  # tokens per hash id in the published traces
DATA_DIR = Path(__file__).parent / "data" / "mooncake"
MOONCAKE_TRACES = {"conversation": "conversation_trace.jsonl",
                   "synthetic": "synthetic_trace.jsonl"}


def expand_hash_ids(hash_ids: tuple[int, ...] | list[int], input_length: int,
                    block_size: int) -> list[int]:
    """Keys of the ceil(input_length / block_size) prompt blocks (the module's sub-block rule),
    equal exactly when the 512-token blocks are equal; block_size 512 returns the ids."""
    if not isinstance(block_size, int) or block_size < 1 or TRACE_BLOCK_SIZE % block_size:
        raise ValueError(f"block_size must divide {TRACE_BLOCK_SIZE} (the trace's block), "
                         f"got {block_size!r}")
    per_block = TRACE_BLOCK_SIZE // block_size
    num_blocks = -(-input_length // block_size)
    keys = [h * per_block + j for h in hash_ids for j in range(per_block)]
    return keys[:num_blocks]


def block_keys(request: Request, block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """Prefix-identity keys of a trace request's prompt blocks of `block_size` tokens."""
    return expand_hash_ids(request.trace_block_ids, request.prompt_len, block_size)


@dataclasses.dataclass
class MooncakeTrace:
    """A loaded trace: the requests kept, in arrival order, and those over max_model_len counted."""

    name: str
    path: Path
    requests: list[Request]
    max_model_len: int | None
    num_rejected: int
    num_lines: int

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(request.prompt_len for request in self.requests)


def mooncake_trace_path(name: str) -> Path:
    """Path of a shipped trace ('conversation' or 'synthetic')."""
    if name not in MOONCAKE_TRACES:
        raise ValueError(f"unknown Mooncake trace {name!r}; shipped: {', '.join(MOONCAKE_TRACES)}")
    return DATA_DIR / MOONCAKE_TRACES[name]


def load_mooncake_trace(trace: str | Path = "conversation", max_model_len: int | None = None,
                        limit: int | None = None) -> MooncakeTrace:
    """Read a Mooncake JSONL trace (shipped name or path), at most `limit` lines, checking each.
    TraceFormatError, starting "path:line:", names the fault: not JSON, a missing or non-integer
    field, input_length < 1, output_length < 0, hash_ids of the wrong count, time going back."""
    for label, value in (("max_model_len", max_model_len), ("limit", limit)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if isinstance(trace, str) and trace in MOONCAKE_TRACES:
        name, path = trace, mooncake_trace_path(trace)
    else:
        path = Path(trace)
        name = path.name
    requests: list[Request] = []
    num_lines = num_rejected = 0
    previous_ms = 0
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # a blank line (e.g. a trailing newline) is not a request
            request, previous_ms = _parse_line(line, f"{path}:{line_number}", previous_ms)
            num_lines += 1
            if max_model_len is not None and request.total_len > max_model_len:
                num_rejected += 1
            else:
                requests.append(request)
            if limit is not None and num_lines >= limit:
                break
    return MooncakeTrace(name, path, requests, max_model_len, num_rejected, num_lines)


def _parse_line(line: str, where: str, previous_ms: int) -> tuple[Request, int]:
    """The line's request and its timestamp in ms (the next line's lower bound)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"{where}: not a JSON object ({error.msg})") from None
    if not isinstance(row, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")

    def integer(field: str, minimum: int) -> int:
        if field not in row:
            raise TraceFormatError(f"{where}: missing field {field!r}")
        value = row[field]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TraceFormatError(f"{where}: {field}={value!r} is not an integer")
        if value < minimum:
            raise TraceFormatError(f"{where}: {field}={value} must be >= {minimum}")
        return value

    timestamp = integer("timestamp", 0)
    if timestamp < previous_ms:
        raise TraceFormatError(f"{where}: timestamp {timestamp} ms is before the previous "
                               f"line's {previous_ms} ms (arrivals must be in order)")
    input_length = integer("input_length", 1)
    output_length = integer("output_length", 0)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers >= 0, "
                               f"got {str(hash_ids)[:60]}")
    expected = -(-input_length // TRACE_BLOCK_SIZE)
    if len(hash_ids) != expected:
        raise TraceFormatError(f"{where}: input_length={input_length} needs {expected} hash_ids "
                               f"(one per {TRACE_BLOCK_SIZE}-token block), got {len(hash_ids)}")
    return Request(input_length, output_length, timestamp / 1000.0, tuple(hash_ids),
                   TRACE_BLOCK_SIZE), timestamp
