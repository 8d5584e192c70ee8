"""Offline generation on the one serving design: `LLMEngine` and `generate_batch`.

vLLM runs offline batches (`LLM.generate`) and online traffic on the same engine core; so does the
course. `LLMEngine` is stage 7's `Scheduler`, a KV cache manager (`KVCacheManager`, or
`PrefixCachingKVCacheManager` with `enable_prefix_caching=True`) and a `ModelRunner` over a
`PagedKVCache`, stepped by the `engine_step` that `serve` uses. It adds n completions of one
prompt, whose forks share the prompt's blocks and copy one only to write into it (copy-on-write,
Kwon et al., SOSP 2023, section 4.4); sampling, one random stream per completion
(`kvlab.sampling`); forced first tokens and end-of-sequence tokens; validation of each request
before it is queued; the counts stages 4 and 6 print; and `generate_batch`, a batch in one call.
`kvlab.generate.generate` is the one-prompt front door.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence as Seq

from ..errors import RequestTooLongError
from ..paged.backends import BackendLike
from ..paged.budget import check_pool_fits, kv_block_bytes
from ..paged.block_table import cdiv
from ..paged.paged_cache import PagedKVCache
from ..prefix.block_hash import HashFunction, extra_keys_for, sha256
from ..prefix.views import PrefixCacheStats
from ..checks import check_int, check_model_len, check_request
from ..sampling import check_temperature, stream_seed
from ..sampling import SamplingParams, stop_token_ids
from .engine_core import engine_step
from .model_runner import ModelRunner
from .request import Request
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .strategies import paged_manager

__all__ = ["EngineStats", "LLMEngine", "BatchResult", "generate_batch", "default_pool_size"]


@dataclasses.dataclass
class EngineStats:
    """What a run cost, in tokens or blocks, never bytes (x bytes_per_token or block_bytes)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0   # tokens whose K/V were dropped by preemption and redone
    num_prefill_tokens: int = 0      # prompt tokens run (prefix hits are not), plus recomputation
    peak_blocks_in_use: int = 0      # physical blocks held at the fullest moment
    # block-table entries minus physical blocks held, at its largest: blocks sharing saved (a
    # fork of a 5-block prompt into 4 tables: 20 entries over 5 blocks, 15 saved)
    blocks_saved_by_sharing: int = 0
    peak_blocks_unshared: int = 0    # most block-table entries at once: blocks held unshared
    num_cow_copies: int = 0          # blocks copied by copy-on-write


class LLMEngine:
    """Continuous batching over a paged KV cache: `add_request`, `step` (or `run`), `outputs`.

    A *request* (one prompt, n completions) is named by the index `add_request` returns, which
    `outputs` and `sequences` take; each completion is a *sequence*, a scheduler `Request` whose
    `request_id` numbers every sequence (its block table's key, as a sequence id in vLLM v0).

    Args:
        model: the decoder (its dtype and device are the pool's).
        max_model_len: longest request (prompt + max_new_tokens); default, and at most, the
            model's max_position_embeddings. Checked against the pool at start-up.
        max_num_seqs: most sequences running at once (a request for n completions counts n).
        eos_token_id: one stop id or several (end-of-sequence and end-of-turn), as `SamplingParams`.
        enable_prefix_caching, hash_fn: share full blocks by prefix (stage 6), with this hash.
        max_num_batched_tokens: tokens computed per step; longer prompts are prefilled in chunks.
            Default max(max_model_len, 2,048): any prompt in one step (the rule before chunked
            prefill; vLLM v1's offline `LLM` default is 16,384 on large GPUs, 8,192 elsewhere).

    Raises:
        KVCacheOutOfMemory: the pool cannot hold one max_model_len request.
        ValueError: bad sizes, max_model_len > max_position_embeddings, eos_token_id outside the
            vocabulary, a temperature that is not a finite number >= 0.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 eos_token_id: int | Seq[int] | None = None, temperature: float = 0.0,
                 seed: int = 0,
                 attention_backend: BackendLike = None, enable_prefix_caching: bool = False,
                 hash_fn: HashFunction = sha256, max_num_batched_tokens: int | None = None):
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        self.temperature = check_temperature(temperature)
        self.seed = check_int("seed", seed, 0)
        self.model = model
        self.stop_token_ids = stop_token_ids(eos_token_id, model.config.vocab_size)
        self.max_model_len = check_model_len(model.config, max_model_len)
        # vLLM's start-up check, with the bytes in its message, before anything is built
        check_pool_fits(check_int("num_blocks", num_blocks, 1), check_int("block_size",
                        block_size, 1), self.max_model_len,
                        kv_block_bytes(model.config, block_size, model.dtype))
        self.kv = paged_manager(num_blocks, block_size, self.max_model_len,
                                enable_prefix_caching, hash_fn)  # the cache gets it below
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, self.max_model_len,
                                            attention_backend, manager=self.kv)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(self.max_model_len, 2048)
        self.scheduler = Scheduler(self.kv, SchedulerConfig(max_num_seqs, max_num_batched_tokens))
        self.executor = ModelRunner(model, self.cache)
        self.requests: list[list[Request]] = []  # request_id -> its n completions
        self.stats = EngineStats()
        self._num_sequences = 0
        self._clock_start = time.perf_counter()

    def add_request(self, prompt: Seq[int], max_new_tokens: int, n: int = 1,
                    first_tokens: Seq[int] | None = None, seed: int | None = None,
                    cache_salt: str | None = None) -> int:
        """Queue a request for n completions of one prompt; returns its index, not a `request_id`.

        Args:
            first_tokens: n token ids, forced as each completion's first token.
            seed: the same prompt and seed give the same samples wherever the request sits in a
                batch; None: derived from the engine's seed and the request's index.
            cache_salt: with prefix caching, only requests with the same salt share blocks.

        Raises:
            RequestTooLongError: prompt + max_new_tokens > max_model_len.
            ValueError: empty prompt, bad token ids, bad n, first_tokens or seed.
            TypeError: cache_salt is not a str.
        """
        check_int("max_new_tokens", max_new_tokens, 1)
        total = len(prompt) + max_new_tokens
        if total > self.max_model_len:
            cache = self.cache
            raise RequestTooLongError(
                f"request of {len(prompt)} prompt tokens + max_new_tokens={max_new_tokens} = "
                f"{total} tokens ({cdiv(total, cache.block_size)} blocks of {cache.block_size}) > "
                f"max_model_len={self.max_model_len} (the pool holds {cache.num_blocks} blocks = "
                f"{cache.num_blocks * cache.block_size} tokens); rejected")
        vocab_size = self.model.config.vocab_size
        check_request(prompt, max_new_tokens, self.max_model_len, vocab_size)
        check_int("n (at most max_num_seqs)", n, 1, self.scheduler.config.max_num_seqs)
        if seed is not None:
            check_int("seed", seed, 0)
        if first_tokens is not None:
            if len(first_tokens) != n:
                raise ValueError(f"first_tokens has {len(first_tokens)} ids for n={n} completions")
            for token in first_tokens:
                check_int("first_tokens entry", token, 0, vocab_size - 1)
        extra_keys_for(cache_salt)  # refuse a bad salt before anything is queued

        prompt = [check_int("token id", t, 0, vocab_size - 1) for t in prompt]
        request_id = len(self.requests)
        family = []
        for sibling in range(n):
            parts = ("request", seed) if seed is not None else ("engine", self.seed, request_id)
            sampling = SamplingParams(
                self.temperature, stream_seed(*parts, sibling) if self.temperature else None,
                self.stop_token_ids, None if first_tokens is None else int(first_tokens[sibling]))
            family.append(Request(self._num_sequences, 0.0, len(prompt), max_new_tokens,
                                  prompt, sampling=sampling, cache_salt=cache_salt))
            self._num_sequences += 1
        family[0].forks = family[1:]  # forked from completion 0 once its prompt is computed
        self.requests.append(family)
        self.scheduler.add_request(family[0])  # fits: max_model_len was checked above
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def running(self) -> list[Request]:
        """Sequences holding blocks now, oldest admission first."""
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        """Sequences queued for admission (preempted ones first)."""
        return list(self.scheduler.waiting)

    def sequences(self, request_id: int) -> list[Request]:
        """The n sequences (scheduler `Request`s) of the request with this index."""
        return self.requests[request_id]

    def outputs(self, request_id: int) -> list[list[int]]:
        """Generated ids of each completion of the request with this index (so far)."""
        return [list(seq.output_token_ids) for seq in self.requests[request_id]]

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        """Hit rate, blocks saved, prefill tokens skipped, evictions (prefix caching only)."""
        return self.kv.prefix_stats if self.kv.has_prefix_cache else None

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            self.step()

    def step(self) -> None:
        """One scheduler step: reserve (preempting when the pool is dry), admit, run, sample.
        RuntimeError if nothing could run while requests wait (the start-up check rules it out)."""
        stats, scheduler = self.stats, self.scheduler
        stats.num_steps += 1
        now = time.perf_counter() - self._clock_start
        step = engine_step(scheduler, self.executor, now, on_scheduled=self._record_memory)
        if not step.output.scheduled and not scheduler.running and scheduler.waiting:
            raise RuntimeError("scheduler stuck: nothing running and the head of the queue does "
                               "not fit in an empty pool")
        self._record_memory()  # forks made this step share blocks: count their table entries
        stats.num_preemptions = scheduler.num_preemptions
        stats.num_recomputed_tokens = scheduler.num_recomputed_tokens
        stats.num_prefill_tokens = self.executor.num_prefill_tokens
        stats.num_cow_copies = self.kv.num_cow_copies

    def _record_memory(self, output: SchedulerOutput | None = None) -> None:
        manager, stats = self.kv, self.stats
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, manager.num_used_blocks)
        stats.peak_blocks_unshared = max(stats.peak_blocks_unshared, manager.num_logical_blocks)
        saved = manager.num_logical_blocks - manager.num_used_blocks
        stats.blocks_saved_by_sharing = max(stats.blocks_saved_by_sharing, saved)


@dataclasses.dataclass
class BatchResult:
    """Output of `generate_batch`, per prompt: the ids of its first completion (`token_ids`, []
    if rejected), of all n (`completions`), None or the error that rejected it (`errors`); and the
    run's `EngineStats`, `PrefixCacheStats` (None without prefix caching) and `PagedKVCache`."""

    token_ids: list[list[int]]
    completions: list[list[list[int]]]
    errors: list[str | None]
    stats: EngineStats
    prefix_stats: PrefixCacheStats | None
    cache: PagedKVCache


def generate_batch(model, prompts: Seq[Seq[int]], max_new_tokens: int | Seq[int],
                   block_size: int = 16, num_blocks: int | None = None,
                   max_model_len: int | None = None, n: int = 1,
                   eos_token_id: int | Seq[int] | None = None, max_num_seqs: int = 256,
                   first_tokens: Seq[Seq[int] | None] | None = None, temperature: float = 0.0,
                   seed: int = 0, seeds: Seq[int | None] | None = None,
                   cache_salts: Seq[str | None] | None = None,
                   enable_prefix_caching: bool = False, hash_fn: HashFunction = sha256,
                   attention_backend: BackendLike = None) -> BatchResult:
    """Generate for a batch of prompts through a paged KV cache (greedy by default).

    Prompts are admitted in order, so with prefix caching a prompt can hit the blocks of any earlier
    one still running or not yet evicted. A prompt `add_request` refuses (too long, empty, bad ids
    or salt) gets [] and its error; the others are generated as if it were not there.

    Args (the others: as `LLMEngine` and `LLMEngine.add_request`):
        max_new_tokens: one int for every prompt, or one per prompt.
        num_blocks, max_model_len: default `default_pool_size` (nothing is preempted).
        first_tokens, seeds, cache_salts: per prompt None or its value for `add_request`.

    Raises:
        KVCacheOutOfMemory: the pool cannot hold one max_model_len request.
        ValueError: no prompts, mismatched list lengths, bad sizes or max_model_len.
    """
    if len(prompts) == 0:
        raise ValueError("generate_batch needs at least one prompt")
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    for name, values in (("max_new_tokens", max_new_tokens), ("first_tokens", first_tokens),
                         ("seeds", seeds), ("cache_salts", cache_salts)):
        if values is not None and len(values) != len(prompts):
            raise ValueError(f"{len(values)} {name} entries for {len(prompts)} prompts")
    max_new_tokens = [check_int("max_new_tokens", new, 1) for new in max_new_tokens]
    check_int("n (at most max_num_seqs)", n, 1, check_int("max_num_seqs", max_num_seqs, 1))
    lengths = [len(prompt) + new for prompt, new in zip(prompts, max_new_tokens)]
    max_model_len, num_blocks = default_pool_size(model, lengths, n, block_size, max_model_len,
                                                  num_blocks)
    engine = LLMEngine(model, num_blocks, block_size, max_model_len, max_num_seqs, eos_token_id,
                       temperature, seed, attention_backend, enable_prefix_caching, hash_fn)

    def per_prompt(values, index):
        return None if values is None else values[index]

    request_ids: list[int | None] = []
    errors: list[str | None] = []
    for index, (prompt, new) in enumerate(zip(prompts, max_new_tokens)):
        try:
            request_ids.append(engine.add_request(
                prompt, new, n, per_prompt(first_tokens, index), per_prompt(seeds, index),
                per_prompt(cache_salts, index)))
            errors.append(None)
        except (ValueError, TypeError, RequestTooLongError) as error:
            request_ids.append(None)
            errors.append(f"prompt {index}: {error}")
    engine.run()
    completions = [engine.outputs(rid) if rid is not None else [[] for _ in range(n)]
                   for rid in request_ids]
    return BatchResult([c[0] for c in completions], completions, errors, engine.stats,
                       engine.prefix_stats, engine.cache)


def default_pool_size(model, lengths: list[int], n: int, block_size: int,
                      max_model_len: int | None, num_blocks: int | None) -> tuple[int, int]:
    """The batch defaults (max_model_len, num_blocks): the longest request (or what the given pool
    holds) capped at max_position_embeddings; room for every completion at once (no preemption)."""
    if max_model_len is None:
        max_model_len = min(model.config.max_position_embeddings,
                            max(lengths) if num_blocks is None else num_blocks * block_size)
    if num_blocks is None:
        per_sequence = [cdiv(min(length, max_model_len), block_size) for length in lengths]
        num_blocks = max(cdiv(max_model_len, block_size), n * sum(per_sequence))
    return max_model_len, num_blocks
