"""Replay traffic through each cache strategy and count what it reserves against what it uses.

This is `kvlab report`, the course's main job. It needs no model weights and no GPU: a strategy
decides how many token *slots* a request has reserved at each decode step, and the workload decides
how many tokens it really holds. At the KV shape of a real model (bytes per token) that gives bytes.

Definitions (one request of P prompt tokens and G generated tokens):

* Its lifetime is S = max(G, 1) decode steps. After step i (0-based) it holds
  held_i = min(P + i + 1, P + G) tokens in the cache (a prefill-only request holds P for one step).
* waste = 1 - sum(held) / sum(reserved), summed over every step of every request.
* kv_reserved_bytes / kv_used_bytes = the bytes one request reserves / fills, averaged over all
  request-steps of the workload (a time average: what an average in-flight request costs).
* requests_held = floor(KV budget / kv_reserved_bytes): how many requests of this traffic the
  budget holds at once. For the contiguous strategy that is budget / (max_model_len x bytes/token).

Requests longer than max_model_len cannot be served by any strategy: they are rejected and counted.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from tqdm.auto import tqdm

from .workload import Request

__all__ = ["CacheStrategy", "ContiguousStrategy", "PagedStrategy", "StrategyRow", "Report", "replay",
           "format_report", "held_token_steps", "decode_steps"]


def decode_steps(request: Request) -> int:
    """S = max(G, 1): steps the request stays in the cache."""
    return max(request.output_len, 1)


def held_token_steps(request: Request) -> int:
    """sum over steps of tokens held: P + (P+1) ... closed form G*P + G(G+1)/2 (P for G = 0)."""
    p, g = request.prompt_len, request.output_len
    if g == 0:
        return p
    return g * p + g * (g + 1) // 2


class CacheStrategy(Protocol):
    """How a cache design reserves KV memory for a request."""

    name: str
    bytes_per_token: int

    def reserved_token_steps(self, request: Request) -> int:
        """sum over the request's decode steps of token slots reserved."""
        ...


@dataclasses.dataclass
class ContiguousStrategy:
    """Naive reservation: a max_model_len slab for the request's whole life (vLLM paper, section 3)."""

    max_model_len: int
    bytes_per_token: int
    name: str = "contiguous"

    def reserved_token_steps(self, request: Request) -> int:
        return decode_steps(request) * self.max_model_len


def _block_slots_up_to(tokens: int, block_size: int) -> int:
    """sum_{n=1}^{tokens} ceil(n / block_size) * block_size, in closed form.

    With q = tokens // block_size full blocks and r = tokens % block_size left over, the counts
    n = 1..B each need 1 block, B+1..2B need 2, ..., so the sum is B*(B*(1 + ... + q)) + r*B*(q + 1).
    """
    q, r = divmod(tokens, block_size)
    return block_size * (block_size * q * (q + 1) // 2 + r * (q + 1))


@dataclasses.dataclass
class PagedStrategy:
    """Paged allocation: ceil(held / block_size) blocks at each step (vLLM paper, section 4.2).

    A request reserves a block only when its tokens cross a block boundary, so at most
    block_size - 1 slots of its last block are empty: waste below one block per sequence.
    """

    block_size: int
    bytes_per_token: int
    name: str = "paged"

    def reserved_token_steps(self, request: Request) -> int:
        p, g = request.prompt_len, request.output_len
        if g == 0:
            return _block_slots_up_to(p, self.block_size) - _block_slots_up_to(p - 1,
                                                                                self.block_size)
        # steps hold P+1 ... P+G tokens
        return (_block_slots_up_to(p + g, self.block_size)
                - _block_slots_up_to(p, self.block_size))


@dataclasses.dataclass
class StrategyRow:
    """One line of the report (bytes are averages per in-flight request; waste is a fraction)."""

    strategy: str
    kv_bytes_per_token: int
    kv_reserved_bytes: int
    kv_used_bytes: int
    waste: float
    requests_held: int


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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def replay(requests: Sequence[Request], strategies: Sequence[CacheStrategy], max_model_len: int,
           kv_budget_bytes: int, workload: str = "", model: str = "") -> Report:
    """Replay request sizes through each strategy.

    Args:
        requests: the traffic.
        strategies: cache designs to compare (each with its own bytes_per_token).
        max_model_len: tokens a request may hold at most; longer requests are rejected.
        kv_budget_bytes: KV memory available (bytes), for requests_held.

    Returns:
        Report with one StrategyRow per strategy, and the rejected count (with a few examples).

    Raises:
        ValueError: no servable request, or a non-positive max_model_len / budget.
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if kv_budget_bytes <= 0:
        raise ValueError(f"the KV budget must be positive, got {kv_budget_bytes} B "
                         f"(are the weights bigger than the GPU?)")
    served = [r for r in requests if r.total_len <= max_model_len]
    rejected = [r for r in requests if r.total_len > max_model_len]
    if not served:
        raise ValueError(f"all {len(requests)} requests are longer than max_model_len="
                         f"{max_model_len}; nothing to replay")

    steps = held = 0
    reserved = [0] * len(strategies)
    for request in tqdm(served, desc="replaying", unit="req", disable=len(served) < 50_000):
        steps += decode_steps(request)
        held += held_token_steps(request)
        for k, strategy in enumerate(strategies):
            reserved[k] += strategy.reserved_token_steps(request)

    rows = []
    for strategy, reserved_steps in zip(strategies, reserved):
        per_token = strategy.bytes_per_token
        reserved_bytes = round(reserved_steps * per_token / steps)
        rows.append(StrategyRow(
            strategy=strategy.name, kv_bytes_per_token=per_token,
            kv_reserved_bytes=reserved_bytes, kv_used_bytes=round(held * per_token / steps),
            waste=1.0 - held / reserved_steps,
            requests_held=kv_budget_bytes // reserved_bytes))
    examples = [{"prompt_len": r.prompt_len, "output_len": r.output_len, "total_len": r.total_len}
                for r in rejected[:3]]
    return Report(rows, len(requests), len(served), len(rejected), examples, max_model_len,
                  kv_budget_bytes, workload, model)


def format_report(report: Report) -> str:
    """The report as a plain-text table (exact bytes and binary units)."""
    from .sizing import format_bytes

    header = ("strategy", "KV/token", "KV reserved / req", "KV used / req", "waste",
              "requests held")
    lines = [(row.strategy, format_bytes(row.kv_bytes_per_token),
              format_bytes(row.kv_reserved_bytes), format_bytes(row.kv_used_bytes),
              f"{row.waste:.1%}", f"{row.requests_held:,}") for row in report.rows]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    table = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(cells, widths)))
             for cells in [header, *lines]]
    table.insert(1, "  ".join("-" * w for w in widths))
    summary = (f"model {report.model}, workload {report.workload}: {report.num_requests:,} "
               f"requests, {report.served:,} served, {report.rejected:,} rejected (longer than "
               f"max_model_len={report.max_model_len:,})\n"
               f"KV budget {format_bytes(report.kv_budget_bytes)} "
               f"({report.kv_budget_bytes:,} B); bytes are averages per in-flight request")
    return summary + "\n\n" + "\n".join(table)
