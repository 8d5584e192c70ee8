"""Replay traffic through each cache strategy and count what it reserves against what it uses.

This is `kvlab report`, the course's main job, with no model weights and no GPU: a strategy
decides how many token *slots* a request has reserved at each scheduler step, the workload how
many tokens it really holds, and a real model's KV bytes per token turns both into bytes. For a
request of P prompt and G generated tokens (a test checks these against the paged engine):

* It lives S = max(G, 1) steps and holds P + i tokens at step i (`kvlab.lifetime` says why).
* waste = 1 - sum(held) / sum(reserved), summed over every step of every request.
* kv_reserved_bytes / kv_used_bytes: what one request reserves / fills, averaged over all
  request-steps (a time average: what an average in-flight request costs).
* requests_held = floor(KV budget / kv_reserved_bytes): exact for the contiguous strategy (every
  request reserves the same max_model_len slab); for paging a **steady-state estimate** (while
  the requests in flight are longer than average, fewer fit), which `measure_held` (`kvlab
  report --measure`) checks with stage 7's scheduler.
* Requests longer than max_model_len cannot be served by any strategy: they are rejected, counted.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from tqdm.auto import tqdm

from .lifetime import decode_steps, held_token_steps
from .workload import Request

__all__ = ["CacheStrategy", "ContiguousStrategy", "PagedStrategy", "StrategyRow", "Report", "replay",
           "measure_held", "format_report", "held_token_steps", "decode_steps", "SERVING_STRATEGY"]


class CacheStrategy(Protocol):
    """How a cache design reserves KV memory for a request. Optional: held_token_steps(request), for
    one whose requests share tokens (paged+prefix counts a shared prefix once)."""

    name: str
    bytes_per_token: int

    def reserved_token_steps(self, request: Request) -> int:
        """Token slots reserved, summed over the request's decode steps."""
        ...


@dataclasses.dataclass
class ContiguousStrategy:
    """Naive reservation: a max_model_len slab for the request's whole life (vLLM paper, section 3)."""

    max_model_len: int
    bytes_per_token: int
    name: str = "contiguous"
    exact_requests_held = True

    def reserved_token_steps(self, request: Request) -> int:
        return decode_steps(request) * self.max_model_len


def _block_slots_up_to(tokens: int, block_size: int) -> int:
    """sum_{n=1}^{tokens} ceil(n / B) * B, B = block_size: with q = tokens // B and r = tokens % B,
    n = 1..B need 1 block, B+1..2B need 2, ..., so it is B*(B*(1 + ... + q)) + r*B*(q + 1)."""
    q, r = divmod(tokens, block_size)
    return block_size * (block_size * q * (q + 1) // 2 + r * (q + 1))


@dataclasses.dataclass
class PagedStrategy:
    """Paged allocation: ceil(held / block_size) blocks at each step (vLLM paper, section 4.2), a
    new block only when the tokens cross a boundary: waste below one block per sequence."""

    block_size: int
    bytes_per_token: int
    name: str = "paged"
    exact_requests_held = False

    def reserved_token_steps(self, request: Request) -> int:
        # The steps hold P, P + 1, ..., P + S - 1 tokens (kvlab.lifetime.tokens_held).
        first = request.prompt_len
        last = first + decode_steps(request) - 1
        return (_block_slots_up_to(last, self.block_size)
                - _block_slots_up_to(first - 1, self.block_size))


@dataclasses.dataclass
class StrategyRow:
    """One line of the report: bytes averaged per in-flight request, waste a fraction;
    requests_held is exact when requests_held_exact, else the steady-state estimate."""

    strategy: str
    kv_bytes_per_token: int
    kv_reserved_bytes: int
    kv_used_bytes: int
    waste: float
    requests_held: int
    requests_held_exact: bool
    requests_held_measured: float | None = None   # `measure_held`: mean while requests waited
    requests_held_measured_peak: int | None = None


@dataclasses.dataclass
class Report:
    rows: list[StrategyRow]
    num_requests: int
    served: int
    rejected: int
    rejected_examples: list[dict]
    max_model_len: int
    kv_budget_bytes: int
    workload: str
    model: str
    kv_budget_source: str = ""  # how the budget was set, e.g. "0.9 x H100-80GB ... - weights"
    tp: int = 1  # tensor-parallel GPUs: bytes and the budget are per GPU
    tp_chosen_because: str | None = None  # why, when no --tp chose it (kvlab.cli.arguments)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def replay(requests: Sequence[Request], strategies: Sequence[CacheStrategy], max_model_len: int,
           kv_budget_bytes: int, workload: str = "", model: str = "",
           kv_budget_source: str = "", tp: int = 1,
           tp_chosen_because: str | None = None) -> Report:
    """Replay request sizes through each strategy (the budget and bytes per token per GPU, the rest
    labels). ValueError: no request servable, or max_model_len or the budget not positive."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if kv_budget_bytes <= 0:
        raise ValueError(f"the KV budget must be positive, got {kv_budget_bytes} B "
                         f"(are the weights bigger than the GPU?)")
    served = [r for r in requests if r.total_len <= max_model_len]
    rejected = [r for r in requests if r.total_len > max_model_len]
    if not served:
        if not requests:
            raise ValueError("the workload has no requests; nothing to replay")
        raise ValueError(f"{_every(len(requests), 'request')} longer than max_model_len="
                         f"{max_model_len:,}; nothing to replay (raise --max-model-len)")

    steps = 0
    reserved, held = [0] * len(strategies), [0] * len(strategies)
    # disable=None: tqdm shows the bar only on a terminal, so a log file or a pipe gets no bars.
    for request in tqdm(served, desc="replaying", unit="req",
                        disable=True if len(served) < 50_000 else None):
        steps += decode_steps(request)
        tokens_held = held_token_steps(request)
        for k, strategy in enumerate(strategies):
            reserved[k] += strategy.reserved_token_steps(request)
            # A strategy that shares tokens between requests (paged+prefix) counts its own.
            own = getattr(strategy, "held_token_steps", None)
            held[k] += own(request) if own else tokens_held

    rows = []
    for strategy, reserved_steps, held_steps in zip(strategies, reserved, held):
        per_token = strategy.bytes_per_token
        reserved_bytes = round(reserved_steps * per_token / steps)
        rows.append(StrategyRow(
            strategy=strategy.name, kv_bytes_per_token=per_token,
            kv_reserved_bytes=reserved_bytes, kv_used_bytes=round(held_steps * per_token / steps),
            waste=1.0 - held_steps / reserved_steps,
            requests_held=kv_budget_bytes // reserved_bytes,
            requests_held_exact=bool(getattr(strategy, "exact_requests_held", False))))
    examples = [{"prompt_len": r.prompt_len, "output_len": r.output_len, "total_len": r.total_len}
                for r in rejected[:3]]
    return Report(rows, len(requests), len(served), len(rejected), examples, max_model_len,
                  kv_budget_bytes, workload, model, kv_budget_source, tp, tp_chosen_because)


# The one table of the designs' names: a row of `kvlab report` / `kvlab serve` -> its stage-7
# strategy (`kvlab.serving.STRATEGIES`, `kvlab serve --strategy`).
SERVING_STRATEGY = {"contiguous-mha": "contiguous", "contiguous": "contiguous", "paged": "paged",
                    "paged+prefix": "prefix"}


def measure_held(report: Report, requests: Sequence[Request], block_size: int) -> None:
    """Fill each row's requests_held_measured(_peak) with stage 7's scheduler, every request queued
    at once (`kvlab.report_capacity`). ValueError: a row whose strategy has no stage-7 manager."""
    from .report_capacity import measure_requests_held  # stage 7, only when asked for

    for row in report.rows:
        if row.strategy not in SERVING_STRATEGY:
            raise ValueError(f"no stage-7 KV manager serves the {row.strategy!r} row")
        held = measure_requests_held(requests, SERVING_STRATEGY[row.strategy],
                                     report.kv_budget_bytes, row.kv_bytes_per_token,
                                     report.max_model_len, block_size)
        row.requests_held_measured, row.requests_held_measured_peak = held.mean, held.peak


def _every(count: int, noun: str) -> str:
    """'the 1 request is' / 'all 3 requests are' (the request count in words that agree)."""
    return f"the 1 {noun} is" if count == 1 else f"all {count:,} {noun}s are"


def format_report(report: Report) -> str:
    """The report as a plain-text table (exact bytes and binary units) with its definitions."""
    from .sizing import format_bytes, plural

    measured = any(row.requests_held_measured is not None for row in report.rows)
    header = ("strategy", "KV/token", "KV reserved / req", "KV used / req", "waste",
              "requests held") + (("measured mean / peak",) if measured else ())
    lines = [(row.strategy, format_bytes(row.kv_bytes_per_token),
              format_bytes(row.kv_reserved_bytes), format_bytes(row.kv_used_bytes),
              f"{row.waste:.1%}", f"{row.requests_held:,}" + ("" if row.requests_held_exact
                                                              else " (est.)"))
             + ((f"{row.requests_held_measured:,.1f} / {row.requests_held_measured_peak:,}",)
                if measured else ())
             for row in report.rows]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    table = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(cells, widths)))
             for cells in [header, *lines]]
    table.insert(1, "  ".join("-" * w for w in widths))
    budget = f"KV budget {format_bytes(report.kv_budget_bytes)} ({report.kv_budget_bytes:,} B)"
    if report.kv_budget_source:
        budget += f" = {report.kv_budget_source}"
    on_gpus = f" at tp {report.tp} (bytes per GPU)" if report.tp > 1 else ""
    summary = [f"model {report.model}{on_gpus}, workload {report.workload}:",
               f"{plural(report.num_requests, 'request')}, {report.served:,} served, "
               f"{report.rejected:,} rejected (longer than max_model_len="
               f"{report.max_model_len:,})",
               budget,
               *([report.tp_chosen_because] if report.tp_chosen_because else []),
               "bytes are averages per in-flight request"]
    notes = []
    if any(not row.requests_held_exact for row in report.rows):
        notes += ["", "(est.) a steady-state estimate: KV budget / what an average in-flight request",
                  "reserves. While the requests in flight are longer than average, fewer fit."]
    if measured:
        notes += ["measured: stage 7's scheduler (kvlab.serving) with every request queued at "
                  "once; requests", "running while others waited, mean / peak "
                  "(kvlab.report_capacity)."]
    return "\n".join(summary) + "\n\n" + "\n".join(table + notes)
