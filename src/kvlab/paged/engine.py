"""Batched greedy generation over the paged KV cache, with preemption by recompute.

A scheduler in the style of vLLM (Kwon et al., SOSP 2023, section 4.5; the vLLM v1 scheduler), cut
to what the paged cache needs. Each `step`:

1. Decode slots. Every running sequence, oldest first, reserves the slot of its next token. If the
   block pool has run dry, the *newest* running sequence is preempted: its blocks are freed and it
   goes back to the front of the waiting queue, to be recomputed later (its prompt and the tokens it
   generated so far are prefilled again at positions 0, 1, ...). Serving the oldest first means the
   oldest always make progress, so the server never livelocks.
2. Admission. If nothing was preempted this step, waiting sequences are admitted first come, first
   served while their prefill fits in the free blocks and max_num_seqs allows.
3. One forward pass for the whole decode batch: the newest token of every running sequence, flat
   [num_seqs], each writing its K/V to its slot and attending over its own blocks.
4. One forward pass per admitted sequence over all its tokens (prefill). A fresh request with n > 1
   completions then forks n - 1 siblings that share the prompt's blocks (section 4.4).

Requests that could never fit are rejected by `add_request` before they enter the queue.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence as Seq

import torch

from ..errors import NoFreeBlocksError, RequestTooLongError
from ..model import LlamaForCausalLM
from ..requests import check_int, check_model_len, check_request
from ..sampling import check_temperature, make_generator, next_token
from .backends import BackendLike
from .block_table import cdiv
from .paged_cache import PagedKVCache

__all__ = ["Sequence", "PagedStats", "PagedEngine"]


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion being generated. seq_id = (request_id, sibling), sibling in 0 .. n - 1."""

    seq_id: tuple[int, int]
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    first_token: int | None = None           # forced first generated token, if given
    generator: torch.Generator | None = None  # for sampling (temperature > 0)
    siblings_to_fork: list["Sequence"] = dataclasses.field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """Prompt + output: what a prefill after preemption must recompute."""
        return self.prompt + self.output


@dataclasses.dataclass
class PagedStats:
    """What a run cost. Counts are tokens or blocks, never bytes (multiply by the cache's
    bytes_per_token or block_bytes)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0   # tokens whose K/V were dropped by preemption and redone
    num_prefill_tokens: int = 0      # tokens run through prefill, recomputation included
    peak_blocks_in_use: int = 0      # physical blocks held at the fullest moment
    blocks_saved_by_sharing: int = 0  # most block-table entries that pointed at a shared block
    peak_blocks_unshared: int = 0    # most block-table entries at once: what the same sequences
                                     # would hold as separate requests, nothing shared
    num_cow_copies: int = 0          # blocks copied by copy-on-write


class PagedEngine:
    """Continuous batching over a `PagedKVCache`: add requests, then `step` (or `run`).

    Args:
        model: the decoder (its dtype and device are the pool's).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        max_model_len: longest request (prompt + max_new_tokens); default the model's
            max_position_embeddings, never more. Checked against the pool at start-up.
        max_num_seqs: most sequences running at once.
        eos_token_id: a sequence stops after generating it.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        seed: the seed of requests that bring none of their own (see `kvlab.sampling`); each
            sequence has its own generator, so samples do not depend on how the batch was
            scheduled or preempted.
        attention_backend: the paged cache's attention backend (see `kvlab.paged.backends`).

    Raises:
        KVCacheOutOfMemory: the pool cannot hold one max_model_len request (numbers in the message).
        ValueError: bad sizes, max_model_len > max_position_embeddings, eos_token_id outside the
            vocabulary, a temperature that is not a finite number >= 0.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 eos_token_id: int | None = None, temperature: float = 0.0, seed: int = 0,
                 attention_backend: BackendLike = None):
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        self.temperature = check_temperature(temperature)
        self.seed = check_int("seed", seed, 0)
        if eos_token_id is not None:
            check_int("eos_token_id", eos_token_id, 0, model.config.vocab_size - 1)
        self.model, self.eos_token_id = model, eos_token_id
        self.max_model_len = check_model_len(model.config, max_model_len)
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, self.max_model_len,
                                            attention_backend)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.requests: list[list[Sequence]] = []  # request_id -> its n sequences
        self.stats = PagedStats()

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, prompt: Seq[int], max_new_tokens: int, n: int = 1,
                    first_tokens: Seq[int] | None = None, seed: int | None = None) -> int:
        """Queue a request for n completions of one prompt; returns its request_id.

        Args:
            prompt: token ids.
            max_new_tokens: tokens to generate per completion.
            n: completions (parallel sampling); they share the prompt's blocks.
            first_tokens: optional n token ids forced as each completion's first token (makes
                greedy siblings diverge, so copy-on-write is visible).
            seed: this request's sampling seed (temperature > 0): the same prompt and seed give
                the same samples wherever the request sits in a batch. None: derived from the
                engine's seed and the request's index (independent of every other request).

        Raises:
            RequestTooLongError: prompt + max_new_tokens > max_model_len. The start-up check makes
                the pool hold max_model_len tokens, so this also covers "longer than the pool".
            ValueError: empty prompt, bad token ids, bad n, first_tokens or seed.
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
        check_int("n (at most max_num_seqs)", n, 1, self.max_num_seqs)
        if seed is not None:
            check_int("seed", seed, 0)
        if first_tokens is not None:
            if len(first_tokens) != n:
                raise ValueError(f"first_tokens has {len(first_tokens)} ids for n={n} completions")
            for token in first_tokens:
                check_int("first_tokens entry", token, 0, vocab_size - 1)

        prompt = [check_int("token id", t, 0, vocab_size - 1) for t in prompt]
        request_id = len(self.requests)
        family = []
        for sibling in range(n):
            generator = None
            if self.temperature > 0:
                # A request's own seed alone decides its streams; without one, its index does.
                parts = (("request", seed) if seed is not None
                         else ("engine", self.seed, request_id))
                generator = make_generator(self.model.device, *parts, sibling)
            family.append(Sequence((request_id, sibling), list(prompt),
                                   max_new_tokens, generator=generator,
                                   first_token=None if first_tokens is None
                                   else int(first_tokens[sibling])))
        family[0].siblings_to_fork = family[1:]  # forked from sibling 0 once its prompt is cached
        self.requests.append(family)
        self.waiting.append(family[0])
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def outputs(self, request_id: int) -> list[list[int]]:
        """Generated ids of each completion of a request (so far)."""
        return [list(seq.output) for seq in self.requests[request_id]]

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            self.step()

    # ---- one scheduler step ------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Reserve decode slots (preempting when dry), admit, one decode pass, prefill admitted ones."""
        self.stats.num_steps += 1
        preemptions_before = self.stats.num_preemptions
        decode_slots = self._reserve_decode_slots()
        decode_batch = list(self.running)
        # Admitting right after a preemption would only hand the freed blocks to a newer request.
        admitted = self._admit() if self.stats.num_preemptions == preemptions_before else []
        if not decode_batch and not admitted and self.waiting:
            raise RuntimeError("scheduler stuck: nothing running and the head of the queue does not "
                               "fit in an empty pool")  # cannot happen after the start-up check
        self._record_memory()
        if decode_batch:
            self._decode(decode_batch, decode_slots)
        for seq, slots, start in admitted:
            self._prefill(seq, slots, start)
        self.stats.num_cow_copies = self.cache.manager.num_cow_copies

    def _reserve_decode_slots(self) -> list[int]:
        """One slot per running sequence, oldest first; preempt the newest while the pool is dry."""
        slots: list[int] = []
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            try:
                slots.append(self._reserve_next_slot(seq))
                index += 1
            except NoFreeBlocksError:
                # May be `seq` itself when it is the newest: then the loop ends.
                self._preempt(self.running[-1])
        return slots

    def _reserve_next_slot(self, seq: Sequence) -> int:
        """The slot of the token `seq` feeds back this step (copy-on-write included). Stage 6's
        prefix cache overrides this to name the token, so a block it fills is cached at once.

        Raises:
            NoFreeBlocksError: the pool is dry (nothing changed).
        """
        return int(self.cache.append_slots(seq.seq_id, 1))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's blocks, queue it first to prefill again."""
        self.running.remove(seq)
        self.stats.num_recomputed_tokens += self.cache.preempt(seq.seq_id)
        self.stats.num_preemptions += 1
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)  # several preempted in one step keep their relative order

    def _admit(self) -> list[tuple[Sequence, torch.Tensor, int]]:
        """Take waiting sequences (first come, first served) while blocks and max_num_seqs allow.

        Returns (sequence, slots to prefill, position where prefill starts) per admitted one."""
        admitted = []
        num_seqs = len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            family_size = 1 + len(seq.siblings_to_fork)
            if num_seqs + family_size > self.max_num_seqs:
                break
            try:
                slots, start = self._allocate_prompt(seq)
            except NoFreeBlocksError:
                break  # the head waits for blocks; no overtaking, so it cannot starve
            self.waiting.popleft()
            admitted.append((seq, slots, start))
            num_seqs += family_size
        return admitted

    def _allocate_prompt(self, seq: Sequence) -> tuple[torch.Tensor, int]:
        """Blocks for all of a sequence's tokens; (their slots, 0: prefill starts at position 0).

        Stage 6's prefix cache overrides this: tokens found in the cache need no slots, and prefill
        starts after them (vLLM's num_computed_tokens)."""
        return self.cache.allocate(seq.seq_id, len(seq.tokens)), 0

    def _decode(self, batch: list[Sequence], slots: list[int]) -> None:
        """One forward pass: the newest token of each sequence at its position, flat [num_seqs]."""
        device = self.model.device
        token_ids = torch.tensor([seq.output[-1] for seq in batch], device=device)
        positions = torch.tensor([len(seq.tokens) - 1 for seq in batch], device=device)
        store = self.cache.decode_store([seq.seq_id for seq in batch],
                                        torch.tensor(slots, device=device))
        logits = self.model(token_ids, positions, store)  # [num_seqs, vocab_size]
        for seq, row in zip(batch, logits):
            self._append_token(seq, self._next_token(seq, row))

    def _prefill(self, seq: Sequence, slots: torch.Tensor, start: int = 0) -> None:
        """Run a sequence's tokens from `start` on (prompt, + output after a preemption) at their
        absolute positions, attending over all of them; sample the next token."""
        tokens = seq.tokens
        device = self.model.device
        store = self.cache.prefill_store(seq.seq_id, slots)
        logits = self.model(torch.tensor(tokens[start:], device=device),
                            torch.arange(start, len(tokens), device=device), store)[-1]
        self.stats.num_prefill_tokens += len(tokens) - start
        family = [seq] + seq.siblings_to_fork
        for sibling in seq.siblings_to_fork:  # share the prompt's blocks, copy nothing
            self.cache.fork(seq.seq_id, sibling.seq_id)
        seq.siblings_to_fork = []
        self.running.extend(family)
        self._record_memory()
        for member in family:  # every sibling's first token comes from the same logits
            self._append_token(member, self._next_token(member, logits))

    def _next_token(self, seq: Sequence, logits: torch.Tensor) -> int:
        """Forced first token, else greedy (temperature 0) or a sample from the sequence's generator."""
        if not seq.output and seq.first_token is not None:
            return seq.first_token
        return next_token(logits, self.temperature, seq.generator)

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)
        if token == self.eos_token_id or len(seq.output) == seq.max_new_tokens:
            seq.finished = True
            self.running.remove(seq)
            self.cache.free(seq.seq_id)  # its blocks are free for the next step

    def _record_memory(self) -> None:
        manager, stats = self.cache.manager, self.stats
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, manager.num_used_blocks)
        stats.peak_blocks_unshared = max(stats.peak_blocks_unshared, manager.num_logical_blocks)
        saved = manager.num_logical_blocks - manager.num_used_blocks
        stats.blocks_saved_by_sharing = max(stats.blocks_saved_by_sharing, saved)
