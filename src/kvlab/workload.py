"""Traffic: how many tokens each request brings (prompt) and asks for (output).

Real traffic is long-tailed, and the waste of a KV-cache design depends on it, so the course
replays a real production trace: the **Azure LLM inference trace 2023, conversation service**
(Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024;
Azure Public Dataset, CC BY 4.0), shipped as `kvlab.traces.azure_trace("conv")`.

This module draws *synthetic* traffic for sweeps and arrival processes a fixed trace cannot give
(any number of requests, any seed), by default fitted to the trace's published statistics: prompt
tokens mean 1,155, median 1,020; generated tokens mean 211, median 129. For a log-normal, median =
e^mu and mean = e^(mu + sigma^2 / 2), so mu = ln(median) and sigma = sqrt(2 ln(mean / median)):
prompt ~ LogNormal(6.928, 0.499), output ~ LogNormal(4.860, 0.992). Draws are rounded to whole
tokens, at least 1, and outputs capped at 1,000 tokens as the service capped them (the trace's
maximum), which trims the output mean to about 201 tokens; medians are unchanged.

What the fit does NOT match: the tail. A log-normal through the mean and median has a far thinner
tail than the real prompts: far fewer requests longer than a typical max_model_len, a lower 99th
percentile (`compare_to_trace`; figures in the README and `tests/test_workload.py`). Use the real
trace for waste and rejection figures, the fit for sweeps. The second preset, ShareGPT (vLLM
paper: input mean 161, output mean 338; means only), assumes the Azure fit's spreads.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from .serving.request import Request as ServedRequest

__all__ = ["Request", "LogNormalFit", "AZURE_CONV_2023", "SHAREGPT", "synthetic_requests",
           "share_longer_than", "percentile", "TrafficStats", "traffic_stats", "compare_to_trace",
           "from_sizes", "poisson_arrivals", "speed_up", "shrink", "synthetic_prompt_ids"]


@dataclasses.dataclass(frozen=True)
class Request:
    """A request as a trace or a fit gives it (`kvlab.serving.Request` is the server's): prompt_len
    >= 1, output_len >= 0 tokens (0: prefill only); trace_block_ids: ids of the prompt's blocks of
    trace_block_size tokens (Mooncake: 512), equal ids at equal positions a shared prefix, empty
    for Azure and synthetic traffic (not vLLM's chained `block_hashes`); num_cached_tokens: leading
    prompt tokens a prefix cache supplied in a replay (`kvlab.prefix.report_row`), else 0."""

    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    trace_block_ids: tuple[int, ...] = ()
    trace_block_size: int = 0
    num_cached_tokens: int = 0

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
    """Sizes drawn from `fit` by `random.Random` (Mersenne Twister, the same on every platform),
    so a seed gives the same requests everywhere. ValueError: num_requests < 1."""
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


def share_longer_than(requests: Sequence[Request], tokens: int) -> float:
    """Fraction of requests whose prompt + output exceeds `tokens`: those a server with
    max_model_len = tokens must reject. ValueError: no requests."""
    if not requests:
        raise ValueError("no requests: the share of an empty workload is undefined")
    return sum(r.total_len > tokens for r in requests) / len(requests)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics (numpy's default, as vLLM's
    benchmarks report), nan for no values: the course's one, for traffic and replay latencies.
    percentile([1, 2, 3, 4], 50) == 2.5. ValueError: q outside [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclasses.dataclass(frozen=True)
class TrafficStats:
    """Summary of a workload, in tokens (shares are fractions of all requests)."""

    num_requests: int
    prompt_mean: float
    prompt_median: float
    prompt_p99: float
    output_mean: float
    output_median: float
    output_p99: float
    share_longer_than: dict[int, float]  # total tokens -> share of requests longer


def traffic_stats(requests: Sequence[Request],
                  thresholds: Sequence[int] = (2048, 4096, 8192)) -> TrafficStats:
    """Mean, median and p99 of prompt and output lengths, and tail shares; ValueError: none."""
    import statistics

    if not requests:
        raise ValueError("no requests to summarise")
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    return TrafficStats(
        num_requests=len(requests),
        prompt_mean=statistics.fmean(prompts), prompt_median=statistics.median(prompts),
        prompt_p99=percentile(prompts, 99),
        output_mean=statistics.fmean(outputs), output_median=statistics.median(outputs),
        output_p99=percentile(outputs, 99),
        share_longer_than={t: share_longer_than(requests, t) for t in thresholds})


def compare_to_trace(trace: Sequence[Request], fit: LogNormalFit = AZURE_CONV_2023,
                     seed: int = 0) -> tuple[TrafficStats, TrafficStats]:
    """(trace stats, fit stats) over as many draws as the trace has requests: where a fit to the
    trace's mean and median parts from it (the tail)."""
    return traffic_stats(trace), traffic_stats(synthetic_requests(len(trace), fit, seed=seed))


# ---- requests to serve ------------------------------------------------------------------------
# kvlab.serving reads `percentile` from this module, so its Request is imported where it is used.

def from_sizes(sizes: Iterable[Request], prompt_ids: bool = False, vocab_size: int = 0,
               seed: int = 0) -> list[ServedRequest]:
    """`kvlab.serving.Request`s in arrival order, trace block ids kept; 0 output tokens are served
    as 1 (a server returns at least one). prompt_ids=True: `synthetic_prompt_ids` for each."""
    from .serving.request import Request as ServedRequest

    requests = []
    for index, row in enumerate(sizes):
        request = ServedRequest(index, float(row.arrival_s), int(row.prompt_len),
                                max(1, int(row.output_len)),
                                trace_block_ids=tuple(row.trace_block_ids),
                                trace_block_size=int(row.trace_block_size))
        if prompt_ids:
            request.prompt_token_ids = synthetic_prompt_ids(request, vocab_size, seed)
        requests.append(request)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return requests


def poisson_arrivals(requests: Sequence[ServedRequest], rate: float,
                     seed: int = 0) -> list[ServedRequest]:
    """The same requests arriving as a Poisson process of `rate` (> 0) requests per second: gaps
    exponential with mean 1 / rate, the first at 0 (vLLM's `benchmark_serving --request-rate`)."""
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate}")
    rng, now, out = random.Random(seed), 0.0, []
    for request in requests:
        copy = request.fresh_copy()
        copy.arrival_s = now
        out.append(copy)
        now += rng.expovariate(rate)
    return out


def speed_up(requests: Sequence[ServedRequest], factor: float) -> list[ServedRequest]:
    """Arrival times divided by `factor` (> 0): the trace's bursts, `factor` times denser (the
    load of `factor` such services sent to one deployment). Sizes are unchanged."""
    if not factor > 0:
        raise ValueError(f"speed-up factor must be > 0, got {factor}")
    out = []
    for request in requests:
        copy = request.fresh_copy()
        copy.arrival_s = request.arrival_s / factor
        out.append(copy)
    return out


def shrink(requests: Sequence[ServedRequest], factor: int) -> list[ServedRequest]:
    """Prompt and output lengths divided by `factor` (rounded, at least 1), arrivals kept: the same
    shape (long tail, bursts) at a size the tiny model (1,024 positions) serves on a CPU in seconds.
    Trace block sizes are divided too. ValueError: factor < 1, or one not dividing a block size."""
    from .serving.request import Request as ServedRequest

    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"shrink factor must be a positive integer, got {factor!r}")
    out = []
    for r in requests:
        if r.trace_block_size % factor:
            raise ValueError(f"shrink factor {factor} does not divide the trace block size "
                             f"{r.trace_block_size}")
        out.append(ServedRequest(r.request_id, r.arrival_s, max(1, round(r.prompt_len / factor)),
                                 max(1, round(r.max_output_tokens / factor)), None,
                                 r.trace_block_ids, r.trace_block_size // factor))
    return out


def synthetic_prompt_ids(request: ServedRequest, vocab_size: int, seed: int = 0) -> list[int]:
    """Uniform ids in [0, vocab_size) for a request known only by its length; each trace block's
    seeded by (seed, position, block id), so prompts sharing a prefix of blocks share those ids
    (the prefix cache finds them), the rest by (seed, request_id). ValueError: vocab_size < 1."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    ids: list[int] = []
    size = request.trace_block_size
    for position, block_id in enumerate(request.trace_block_ids if size else ()):
        rng = random.Random(f"{seed}/{position}/{block_id}")
        ids += [rng.randrange(vocab_size) for _ in range(size)]
        if len(ids) >= request.prompt_len:
            break
    rng = random.Random(f"{seed}/request/{request.request_id}")
    ids += [rng.randrange(vocab_size) for _ in range(request.prompt_len - len(ids))]
    return ids[:request.prompt_len]
