"""A request as the server sees it: what arrived, and how far it has got.

The fields follow vLLM v1's `Request`: a request owns its token count and its progress, and the
scheduler only compares two numbers to decide what to run next:

* `num_tokens`: tokens the request has so far, prompt + output tokens sampled;
* `num_computed_tokens`: of those, the tokens whose K/V are in the cache.

A prefill is the case `num_computed_tokens` far behind `num_tokens`, a decode step the case of one
token behind. After a preemption by recompute (Kwon et al., SOSP 2023, section 4.5) the computed
count drops to 0 and the request catches up again, prompt and output alike. That one rule covers
prefill, chunked prefill, decode, prefix-cache hits and recomputation.

What to do with the logits is the request's `SamplingParams` (vLLM's name): greedy or a
temperature, the seed of its random stream, the tokens that end it. A model can have several such
tokens: an instruct model ends a reply with its end-of-turn token (SmolLM2's `<|im_end|>`, Llama
3's `<|eot_id|>`), which may differ from its end-of-sequence token, so a request carries a set of
stop token ids, as vLLM's `SamplingParams.stop_token_ids`, HF's list-valued
`GenerationConfig.eos_token_id` and llama.cpp's end-of-generation ids do. A request for n > 1
completions of one prompt (parallel sampling) carries n - 1 `forks`: siblings that share its
prompt's KV once that is computed, each then sampling on its own (Kwon et al., section 4.4).

Helpers here turn a trace's requests (`kvlab.workload.Request`: sizes, arrival, block ids) into
these, replace arrival times by a Poisson process, and give token ids to requests for model mode.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from typing import Iterable, Sequence

from .. import workload
from ..checks import check_int
from ..sampling import check_temperature

__all__ = ["Request", "RequestState", "SamplingParams", "stop_token_ids", "from_sizes",
           "poisson_arrivals", "speed_up", "shrink", "synthetic_prompt_ids"]


class RequestState(enum.Enum):
    WAITING = "waiting"      # arrived and queued (again, after a preemption)
    RUNNING = "running"      # holds KV memory and is scheduled step after step
    FINISHED = "finished"    # max_output_tokens produced or EOS sampled; its memory is free
    REJECTED = "rejected"    # can never fit (reason in `reject_reason`); never queued


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request's next tokens are chosen from the logits (vLLM's `SamplingParams`, cut down).

    Attributes:
        temperature: 0 = greedy (arg-max); T > 0 samples from softmax(logits / T).
        stream_seed: seed of the request's own random stream (`kvlab.sampling.stream_seed`), so
            its samples do not depend on its batch or on preemption; None with temperature 0.
        stop_token_ids: the request finishes right after sampling any of these (finish reason
            "stop"); empty: it runs to max_output_tokens (finish reason "length"). Any iterable
            of ids is accepted and stored as a frozenset.
        first_token: a forced first output token (the course's way to make greedy siblings
            diverge, so copy-on-write shows); None: sampled like the rest.

    Raises:
        ValueError: a temperature that is not a finite number >= 0, a temperature > 0 without a
            stream_seed, or a token id that is not an integer >= 0.
    """

    temperature: float = 0.0
    stream_seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    first_token: int | None = None

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.temperature > 0 and self.stream_seed is None:
            # Without it every such request would draw from one default stream: identical samples.
            raise ValueError(f"temperature={self.temperature} needs a stream_seed (e.g. "
                             f"kvlab.sampling.stream_seed('request', seed, sibling))")
        if isinstance(self.stop_token_ids, (int, str)):  # one id where a set belongs: say so
            raise ValueError(f"stop_token_ids must be a collection of token ids, got "
                             f"{self.stop_token_ids!r} (write {{{self.stop_token_ids!r}}})")
        # frozen: the normalised set is written once, here, through object.__setattr__
        object.__setattr__(self, "stop_token_ids", frozenset(
            _token_id("stop_token_ids entry", t) for t in self.stop_token_ids))
        if self.first_token is not None:
            _token_id("first_token", self.first_token)


def _token_id(name: str, value) -> int:
    """A token id >= 0, else ValueError (no vocabulary bound here: the engine checks that)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a token id >= 0, got {value!r}")
    return value


def stop_token_ids(eos_token_id, vocab_size: int) -> frozenset[int]:
    """The stop set of a request from an `eos_token_id` argument: None, one id, or several ids
    (as HF's `GenerationConfig.eos_token_id`); ValueError for an id outside [0, vocab_size)."""
    if eos_token_id is None:
        return frozenset()
    several = isinstance(eos_token_id, (list, tuple, set, frozenset))
    ids = list(eos_token_id) if several else [eos_token_id]
    return frozenset(check_int("eos_token_id", t, 0, vocab_size - 1) for t in ids)


GREEDY = SamplingParams()


@dataclasses.dataclass(eq=False)
class Request:
    """One request: sizes in tokens, arrival time in seconds, and its progress while served.

    Args:
        request_id: unique id (the KV manager's sequence id).
        arrival_s: arrival time, seconds from the start of the replay.
        prompt_len: prompt tokens (>= 1).
        max_output_tokens: tokens to generate (>= 1; the server stops after them, as a benchmark
            that ignores end-of-sequence does).
        prompt_token_ids: the prompt's ids (model mode), or None (simulation).
        trace_block_ids: optional ids of the prompt's consecutive blocks of `trace_block_size`
            tokens (a trace's prefix information: equal ids at equal positions = a shared prefix;
            not vLLM's `request.block_hashes`, the chained hashes of the KV blocks).
        trace_block_size: tokens per entry of `trace_block_ids` (0 when there are none).
        sampling: `SamplingParams` (greedy by default; model mode only reads it).
        cache_salt: only prefix-cache blocks hashed with the same salt are shared (one tenant's
            prompts never hit another's; vLLM's `cache_salt`).
        forks: n - 1 sibling requests of the same prompt (parallel sampling). They wait inside
            this request: admitted with it (counted in max_num_seqs), they share its KV when its
            prompt is computed, and from then on run as requests of their own.

    Raises:
        ValueError: a non-positive length, a negative arrival time, or prompt ids of the wrong
            length.
    """

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
        """Tokens the request has now: prompt + outputs sampled so far."""
        return self.prompt_len + self.num_output_tokens

    @property
    def total_len(self) -> int:
        """Most tokens it can reach: prompt + max_output_tokens (what max_model_len bounds)."""
        return self.prompt_len + self.max_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def num_seqs(self) -> int:
        """Sequences this request will run once admitted: itself + its forks not yet made."""
        return 1 + len(self.forks)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of tokens start .. end - 1 (prompt then output); model mode only."""
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def fresh_copy(self) -> "Request":
        """The same request, not yet served (to replay one workload through several strategies)."""
        return Request(self.request_id, self.arrival_s, self.prompt_len, self.max_output_tokens,
                       self.prompt_token_ids, self.trace_block_ids, self.trace_block_size,
                       self.sampling, self.cache_salt, [fork.fresh_copy() for fork in self.forks])


def from_sizes(sizes: Iterable[workload.Request], prompt_ids: bool = False, vocab_size: int = 0,
               seed: int = 0) -> list[Request]:
    """Requests to serve from a trace's or a fit's requests, in arrival order.

    Rows with 0 output tokens are served as 1 (a server always returns at least one token).
    Their `trace_block_ids` / `trace_block_size` are carried over. With prompt_ids=True every
    request gets `synthetic_prompt_ids` (vocab_size needed).
    """
    requests = []
    for index, row in enumerate(sizes):
        request = Request(index, float(row.arrival_s), int(row.prompt_len),
                          max(1, int(row.output_len)), trace_block_ids=tuple(row.trace_block_ids),
                          trace_block_size=int(row.trace_block_size))
        if prompt_ids:
            request.prompt_token_ids = synthetic_prompt_ids(request, vocab_size, seed)
        requests.append(request)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return requests


def poisson_arrivals(requests: Sequence[Request], rate: float, seed: int = 0) -> list[Request]:
    """The same requests arriving as a Poisson process of `rate` (> 0) requests per second: gaps
    exponential with mean 1 / rate, the first at 0 (vLLM's `benchmark_serving --request-rate`)."""
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate}")
    rng, now, out = random.Random(seed), 0.0, []
    for index, request in enumerate(requests):
        copy = request.fresh_copy()
        copy.arrival_s = now
        out.append(copy)
        now += rng.expovariate(rate)
    return out


def speed_up(requests: Sequence[Request], factor: float) -> list[Request]:
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


def shrink(requests: Sequence[Request], factor: int) -> list[Request]:
    """Prompt and output lengths divided by `factor` (rounded, at least 1), arrival times kept.

    For the tiny model on a CPU, whose max_position_embeddings is 1,024: the traffic keeps its shape
    (long tail, bursts) at a size a CPU runs in seconds. Trace block ids are kept, with their
    block size divided too (it must stay a whole number of tokens).

    Raises:
        ValueError: factor < 1, or a trace block size it does not divide.
    """
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"shrink factor must be a positive integer, got {factor!r}")
    out = []
    for r in requests:
        if r.trace_block_size % factor:
            raise ValueError(f"shrink factor {factor} does not divide the trace block size "
                             f"{r.trace_block_size}")
        out.append(Request(r.request_id, r.arrival_s, max(1, round(r.prompt_len / factor)),
                           max(1, round(r.max_output_tokens / factor)), None, r.trace_block_ids,
                           r.trace_block_size // factor))
    return out


def synthetic_prompt_ids(request: Request, vocab_size: int, seed: int = 0) -> list[int]:
    """Token ids for a request known only by its length (model mode on a trace).

    Ids are drawn uniformly from [0, vocab_size). With trace block ids, the tokens of each named
    block are drawn from a generator seeded by (seed, position, block id), so two prompts that share
    a prefix of blocks in the trace share exactly those token ids, and the prefix cache can find
    them. The rest of the prompt is drawn from a generator seeded by (seed, request_id).

    Raises:
        ValueError: vocab_size < 1.
    """
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
