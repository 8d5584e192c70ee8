"""Traffic: how many tokens each request brings (prompt) and asks for (output).

Real traffic is long-tailed, and the waste of a KV-cache design depends on it, so the course
replays request sizes fit to a published production trace, or the trace itself.

Default workload: the **Azure LLM inference trace 2023, conversation service** (Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024; Azure Public
Dataset, CC BY 4.0). Its published statistics are

    context (prompt) tokens:  mean 1,155  median 1,020
    generated tokens:         mean   211  median   129

We fit a log-normal to each: for a log-normal, median = e^mu and mean = e^(mu + sigma^2 / 2), so
mu = ln(median) and sigma = sqrt(2 ln(mean / median)). That gives prompt ~ LogNormal(6.928, 0.499)
and output ~ LogNormal(4.860, 0.992). Draws are rounded to whole tokens, at least 1, and outputs
are capped at 1,000 tokens as the service capped them (the trace's maximum). The cap trims the
output mean to about 201 tokens (the log-normal's tail above 1,000 is cut); medians are unchanged.

ShareGPT statistics from the vLLM paper (input mean 161, output mean 338) are given as a second
preset; the paper reports means only, so its fit assumes the same spreads as the Azure fit.

`load_azure_trace` reads the trace's CSV format, `TIMESTAMP,ContextTokens,GeneratedTokens`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from pathlib import Path

__all__ = ["Request", "LogNormalFit", "AZURE_CONV_2023", "SHAREGPT", "synthetic_requests",
           "load_azure_trace", "TraceFormatError"]


@dataclasses.dataclass(frozen=True)
class Request:
    """Sizes of one request, in tokens. prompt_len >= 1; output_len >= 0 (0: prefill only)."""

    prompt_len: int
    output_len: int
    arrival_s: float = 0.0

    @property
    def total_len(self) -> int:
        """Tokens the request holds at its end: prompt + output."""
        return self.prompt_len + self.output_len


@dataclasses.dataclass(frozen=True)
class LogNormalFit:
    """A log-normal fit to a published mean and median (tokens), with an optional cap."""

    name: str
    prompt_mean: float
    prompt_median: float
    output_mean: float
    output_median: float
    output_cap: int | None = None
    source: str = ""

    @staticmethod
    def mu_sigma(mean: float, median: float) -> tuple[float, float]:
        """(mu, sigma) of the log-normal with this mean and median (requires mean >= median)."""
        return math.log(median), math.sqrt(2.0 * math.log(mean / median))


AZURE_CONV_2023 = LogNormalFit(
    "azure-conv-2023", prompt_mean=1155, prompt_median=1020, output_mean=211, output_median=129,
    output_cap=1000,
    source="Azure LLM inference trace 2023, conversation (Patel et al., Splitwise, ISCA 2024)")

SHAREGPT = LogNormalFit(
    "sharegpt", prompt_mean=161, prompt_median=161 / math.exp(0.499**2 / 2), output_mean=338,
    output_median=338 / math.exp(0.992**2 / 2),
    source="ShareGPT means from the vLLM paper (Kwon et al., SOSP 2023, section 6.1); "
           "spreads assumed equal to the Azure fit")


def synthetic_requests(num_requests: int, fit: LogNormalFit = AZURE_CONV_2023,
                       seed: int = 0) -> list[Request]:
    """Draw request sizes from a log-normal fit; the same seed gives the same requests everywhere.

    Uses Python's `random.Random` (Mersenne Twister), whose draws do not depend on the platform.

    Raises:
        ValueError: num_requests < 1.
    """
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    rng = random.Random(seed)
    prompt_mu, prompt_sigma = fit.mu_sigma(fit.prompt_mean, fit.prompt_median)
    output_mu, output_sigma = fit.mu_sigma(fit.output_mean, fit.output_median)
    requests = []
    for _ in range(num_requests):
        prompt = max(1, round(rng.lognormvariate(prompt_mu, prompt_sigma)))
        output = max(1, round(rng.lognormvariate(output_mu, output_sigma)))
        if fit.output_cap is not None:
            output = min(output, fit.output_cap)
        requests.append(Request(prompt, output))
    return requests


class TraceFormatError(ValueError):
    """A row of a trace file that is not `TIMESTAMP,ContextTokens,GeneratedTokens` (names the line)."""


def load_azure_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a trace in the Azure LLM inference CSV format.

    Args:
        path: CSV with header `TIMESTAMP,ContextTokens,GeneratedTokens`, one request a row.
        limit: read at most this many requests (>= 1).

    Returns:
        Requests in file order; arrival_s is seconds after the first row's timestamp when the
        timestamps parse, else 0.

    Raises:
        ValueError: limit < 1.
        FileNotFoundError: no such file.
        TraceFormatError: missing columns, or a row whose token counts are not integers
            (ContextTokens >= 1, GeneratedTokens >= 0); the message names the line and the value.
    """
    from datetime import datetime

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of requests, got {limit}")
    path = Path(path)
    requests: list[Request] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        needed = {"ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not needed <= set(reader.fieldnames):
            raise TraceFormatError(f"{path}: header must contain TIMESTAMP,ContextTokens,"
                                   f"GeneratedTokens, got {reader.fieldnames}")
        first_time = None
        for row in reader:
            line = reader.line_num
            prompt = _count(row, "ContextTokens", minimum=1, where=f"{path}:{line}")
            output = _count(row, "GeneratedTokens", minimum=0, where=f"{path}:{line}")
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
    return requests


def _count(row: dict, column: str, minimum: int, where: str) -> int:
    raw = row.get(column)
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise TraceFormatError(f"{where}: {column}={raw!r} is not an integer") from None
    if value < minimum:
        raise TraceFormatError(f"{where}: {column}={value} must be >= {minimum}")
    return value
