"""Read a request trace for `kvlab serve`, whichever of the two real formats it is in.

* `.csv`: the Azure LLM inference trace 2023 (`TIMESTAMP,ContextTokens,GeneratedTokens`; Patel et
  al., Splitwise, ISCA 2024; CC BY 4.0), read by `kvlab.workload.load_azure_trace`.
* `.jsonl`: the Mooncake traces (Qin et al., FAST 2025; Apache-2.0): one JSON object a line,
  `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`, where
  hash_ids name the prompt's consecutive 512-token blocks.

Every malformed line is rejected with `file:line` and the bad value.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..workload import TraceFormatError, load_azure_trace

__all__ = ["TraceRow", "load_trace", "MOONCAKE_BLOCK_TOKENS"]

MOONCAKE_BLOCK_TOKENS = 512  # tokens per entry of a Mooncake `hash_ids` list (its README)


@dataclasses.dataclass(frozen=True)
class TraceRow:
    """One request of a trace: sizes in tokens, arrival in seconds from the trace's start."""

    prompt_len: int
    output_len: int
    arrival_s: float
    block_hashes: tuple[int, ...] = ()
    hash_block_size: int = 0


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """Requests of a trace file, in file order (at most `limit`).

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: an unknown extension, or a malformed line (message: file:line: what).
        ValueError: limit < 1.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of requests, got {limit}")
    if path.suffix == ".csv":
        return [TraceRow(r.prompt_len, r.output_len, r.arrival_s)
                for r in load_azure_trace(path, limit)]
    if path.suffix == ".jsonl":
        return _load_mooncake(path, limit)
    raise TraceFormatError(f"{path}: unknown trace format {path.suffix!r}; expected .csv (Azure "
                           f"LLM inference trace) or .jsonl (Mooncake)")


def _load_mooncake(path: Path, limit: int | None) -> list[TraceRow]:
    rows: list[TraceRow] = []
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceFormatError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {line.strip()[:60]}")
            prompt = _field(record, "input_length", 1, where)
            output = _field(record, "output_length", 0, where)
            stamp = record.get("timestamp")
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp < 0:
                raise TraceFormatError(f"{where}: timestamp={stamp!r} must be milliseconds >= 0")
            hashes = record.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise TraceFormatError(f"{where}: hash_ids must be a list of integers")
            rows.append(TraceRow(prompt, output, stamp / 1000.0, tuple(hashes),
                                 MOONCAKE_BLOCK_TOKENS))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _field(record: dict, name: str, minimum: int, where: str) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {name}={value!r} is not an integer")
    if value < minimum:
        raise TraceFormatError(f"{where}: {name}={value} must be >= {minimum}")
    return value
