"""A request as the server sees it: what arrived, and how far it has got.

As in vLLM v1's `Request`, a request owns its progress, and the scheduler compares two numbers to
decide what to run: `num_tokens` (prompt + output tokens sampled so far) and `num_computed_tokens`
(those whose K/V are in the cache). A prefill is the second far behind the first, a decode step
one token behind. After a preemption by recompute (Kwon et al., SOSP 2023, section 4.5) the
computed count drops to 0 and the request catches up, prompt and output alike. That one rule
covers prefill, chunked prefill, decode, prefix-cache hits and recomputation.

A request for n > 1 completions (parallel sampling, section 4.4) carries n - 1 `forks`: siblings
admitted with it, which share its prompt's KV once computed, then sample on their own (as its
`kvlab.sampling.SamplingParams` says). A trace's requests are made by `kvlab.workload.from_sizes`.
"""

from __future__ import annotations

import dataclasses
import enum

from ..sampling import GREEDY, SamplingParams

__all__ = ["Request", "RequestState", "SamplingParams"]


class RequestState(enum.Enum):
    WAITING = "waiting"      # arrived and queued (again, after a preemption)
    RUNNING = "running"      # holds KV memory and is scheduled step after step
    FINISHED = "finished"    # max_output_tokens produced or a stop token sampled; memory freed
    REJECTED = "rejected"    # can never fit (reason in `reject_reason`); never queued


@dataclasses.dataclass(eq=False)
class Request:
    """One request: sizes in tokens (>= 1 each; the server stops after max_output_tokens, as a
    benchmark that ignores end-of-sequence does), arrival in seconds from the replay's start, and
    its progress. prompt_token_ids: None in simulation. trace_block_ids: a trace's ids of the
    prompt's blocks of trace_block_size tokens (equal ids at equal positions = a shared prefix).
    cache_salt: only prefix-cache blocks hashed with the same salt are shared (vLLM's).
    ValueError: a length < 1, a negative arrival time, or prompt ids of the wrong length."""

    request_id: int
    arrival_s: float
    prompt_len: int
    max_output_tokens: int
    prompt_token_ids: list[int] | None = None
    trace_block_ids: tuple[int, ...] = ()
    trace_block_size: int = 0
    sampling: SamplingParams = GREEDY
    cache_salt: str | None = None
    forks: list["Request"] = dataclasses.field(default_factory=list)
    # ---- progress, written by the scheduler ----
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0   # prompt tokens found in the prefix cache at the last admission
    num_preemptions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # "length" (max_output_tokens) or "stop" (a stop token)
    reject_reason: str | None = None
    # the prefix cache's chained hash of each full block (vLLM's request.block_hashes), kept by
    # `kvlab.prefix.PrefixCachingKVCacheManager` from the first lookup on
    kv_block_hashes: list = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.max_output_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt_len={self.prompt_len} and "
                             f"max_output_tokens={self.max_output_tokens} must both be >= 1")
        if not self.arrival_s >= 0:
            raise ValueError(f"request {self.request_id}: arrival_s={self.arrival_s} must be >= 0")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"request {self.request_id}: {len(self.prompt_token_ids)} prompt ids "
                             f"for prompt_len={self.prompt_len}")

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs sampled so far."""
        return self.prompt_len + self.num_output_tokens

    @property
    def total_len(self) -> int:
        """Prompt + max_output_tokens: what max_model_len bounds."""
        return self.prompt_len + self.max_output_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences it runs once admitted: itself + its forks not yet made."""
        return 1 + len(self.forks)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of tokens start .. end - 1, prompt then output (model mode)."""
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def fresh_copy(self) -> "Request":
        """The same request, not yet served (to replay one workload through several strategies)."""
        return Request(self.request_id, self.arrival_s, self.prompt_len, self.max_output_tokens,
                       self.prompt_token_ids, self.trace_block_ids, self.trace_block_size,
                       self.sampling, self.cache_salt, [fork.fresh_copy() for fork in self.forks])
