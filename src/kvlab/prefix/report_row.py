"""The `paged+prefix` row of `kvlab report`, for workloads that carry prefix information.

A Mooncake trace gives each prompt's block hashes, so a replay knows how many leading tokens of each
request a prefix cache would already hold. `kvlab report --trace mooncake-conversation` (or
`mooncake-synthetic`) therefore adds a row next to `paged`:

* the hits come from the LRU prefix cache replayed on the trace (`trace_hit_rate.lru_hit_rate`)
  with a pool as large as the report's KV budget (budget // (512 x KV bytes per token) blocks of
  the trace's 512 tokens);
* a request's hit blocks are counted once, with the request that computed them: the row's
  reservation and use are the blocks and tokens a request *adds* to the pool. That is exact when
  the requests sharing a prefix are in flight together, and optimistic otherwise (a prefix kept
  only by the cache still takes memory, but memory any allocation may reclaim). So its
  "requests held" is an estimate, marked as such; stage 7 measures it by replaying arrivals.

The compute saving needs no such assumption: the hit tokens are prefill tokens not computed.
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
    """Paged allocation where a request's cached prefix blocks are counted once, by their owner.

    At every step the request holds its first num_cached_tokens // block_size blocks through the
    prefix cache (full blocks, shared) and pays for the rest as `PagedStrategy` does.
    """

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
    """The requests of a Mooncake trace with their prefix-cache hits, for `kvlab.report.replay`.

    Args:
        trace: 'mooncake-conversation' or 'mooncake-synthetic'.
        kv_budget_bytes, bytes_per_token: size the LRU cache (blocks of 512 tokens).
        max_model_len: requests longer than this are kept in the list (the report rejects and
            counts them) but not replayed through the cache (a server would never admit them).
        limit: read at most this many requests.

    Returns:
        (requests with their `num_cached_tokens`, a workload label, the LRU replay's
        `TraceHitRate`).

    Raises:
        ValueError: unknown trace, or a budget smaller than one 512-token block.
    """
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

