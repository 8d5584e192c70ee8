"""The `paged+prefix` row of `kvlab report`, for workloads that carry prefix information.

A Mooncake trace gives each prompt's block hashes, so `kvlab report --trace mooncake-*` adds a row
beside `paged`. Hits come from `trace_hit_rate.lru_hit_rate` with the report's KV budget as its
pool (budget // (512 x KV bytes per token) blocks of 512 tokens). Hit blocks count once, with the
request that computed them: exact when the sharers are in flight together, optimistic otherwise
(a prefix kept only by the cache takes memory any allocation may reclaim), so "requests held" is
marked as an estimate and stage 7 measures it. The compute saving is exact: hit tokens are
prefill not computed.
"""

from __future__ import annotations

import dataclasses
from ..lifetime import decode_steps, held_token_steps
from ..report import PagedStrategy
from ..traces.mooncake import TRACE_BLOCK_SIZE, MOONCAKE_TRACES, load_mooncake_trace
from ..workload import Request
from .trace_hit_rate import TraceHitRate, lru_hit_rate

__all__ = ["PrefixPagedStrategy", "mooncake_report_workload",
           "MOONCAKE_REPORT_TRACES", "prefix_note"]

MOONCAKE_REPORT_TRACES = tuple(f"mooncake-{name}" for name in MOONCAKE_TRACES)


@dataclasses.dataclass
class PrefixPagedStrategy(PagedStrategy):
    """`PagedStrategy` less the request's cached_tokens // block_size shared full blocks."""

    name: str = "paged+prefix"

    def _shared_tokens(self, request: Request) -> int:
        return request.num_cached_tokens // self.block_size * self.block_size  # whole blocks

    def reserved_token_steps(self, request: Request) -> int:
        shared = self._shared_tokens(request) * decode_steps(request)
        return super().reserved_token_steps(request) - shared

    def held_token_steps(self, request: Request) -> int:
        return held_token_steps(request) - self._shared_tokens(request) * decode_steps(request)


def mooncake_report_workload(trace: str, kv_budget_bytes: int, bytes_per_token: int,
                             max_model_len: int, limit: int | None = None
                             ) -> tuple[list[Request], str, TraceHitRate]:
    """(requests with their hits, a label, the LRU replay's `TraceHitRate`) for `report.replay`.
    Requests over max_model_len stay listed (the report counts them) but skip the cache.
    ValueError: unknown trace, or a budget below one 512-token block."""
    if trace not in MOONCAKE_REPORT_TRACES:
        raise ValueError(f"unknown trace {trace!r}; Mooncake traces: "
                         f"{', '.join(MOONCAKE_REPORT_TRACES)}")
    capacity = kv_budget_bytes // (TRACE_BLOCK_SIZE * bytes_per_token)
    if capacity < 1:
        raise ValueError(f"a KV budget of {kv_budget_bytes:,} B holds no block of "
                         f"{TRACE_BLOCK_SIZE} tokens x {bytes_per_token:,} B")
    loaded = load_mooncake_trace(trace.removeprefix("mooncake-"), limit=limit).requests
    served = [request for request in loaded if request.total_len <= max_model_len]
    hits = lru_hit_rate(served, capacity)
    hit_of = iter(hits.hit_tokens)
    requests = [dataclasses.replace(r, num_cached_tokens=next(hit_of))
                if r.total_len <= max_model_len else r for r in loaded]
    label = (f"Mooncake {trace.removeprefix('mooncake-')} trace (FAST 2025, shipped), "
             f"prefix cache hit rate {hits.hit_rate:.1%}")
    return requests, label, hits


def prefix_note(hits: TraceHitRate) -> list[str]:
    """Footnote lines for the printed report: where the hits came from, what the row assumes."""
    return ["", f"paged+prefix: an LRU prefix cache on the KV budget ({hits.capacity_blocks:,} "
                f"blocks of {hits.block_size} tokens)",
            f"supplied {hits.num_hit_tokens:,} of {hits.num_query_tokens:,} prompt tokens "
            f"({hits.hit_rate:.1%}): prefill not computed. Their blocks",
            "count once, with the request that computed them (exact when sharers run together;",
            "stage 7 measures it)."]

