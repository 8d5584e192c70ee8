"""Model mode's executor: one scheduled step through the real model and the real cache tensors.

The scheduler decides, this module executes (vLLM v1's model runner, cut to its core). For each
step it:

1. copies the blocks the step's copy-on-write asked for (`SchedulerOutput.blocks_to_copy`);
2. runs one forward pass for every decode token of the step together, flat [num_seqs]: each
   token writes its K/V to its slot and attends over its own blocks (or its own slab);
3. runs each prefill chunk on its own, at its absolute positions (RoPE needs them), attending over
   everything the request has computed before plus the chunk;
4. samples a token for every request whose tokens are now all computed: greedy, or from its own
   random stream (`kvlab.sampling`), or its forced first token. A request whose prompt is now
   computed also samples for its forks, from the same logits row (they share the prompt).

The caches are stage 2's `ContiguousKVCache` (one slab per request, a fork copies the slab) and
stage 4's `PagedKVCache` (slot mapping through the block tables the scheduler's `PagedManager`
fills; its attention backend, torch or the stage-5 Triton kernel, does the reading).
"""

from __future__ import annotations

import time

import torch

from ..attention import grouped_attention
from ..contiguous import ContiguousKVCache
from ..paged.paged_cache import PagedKVCache
from ..sampling import next_token
from .cost_model import CostModel
from .request import Request, RequestState
from .scheduler import SchedulerOutput

__all__ = ["ModelExecutor", "ContiguousDecodeStore"]


class ModelExecutor:
    """The real model over a real cache.

    Args:
        model: the decoder.
        cache: a `ContiguousKVCache` (slabs handed out per request here) or a `PagedKVCache` whose
            `manager` is the one the scheduler's `PagedManager` drives.
        cost_model: if given, its step time is the clock (repeatable); else the wall clock.

    Attributes:
        num_decode_tokens: output tokens fed back one at a time, on top of a cache holding
            every earlier token of the request.
        num_prefill_tokens: every other token run: prompt tokens (a lone last prompt token too,
            though it rides in the decode pass) and tokens recomputed after preemption. A
            prefix-cache hit is not run.
    """

    def __init__(self, model, cache, cost_model: CostModel | None = None):
        self.model, self.cache, self.cost_model = model, cache, cost_model
        self.paged = isinstance(cache, PagedKVCache)
        self.slab_of: dict[int, int] = {}  # contiguous only: request_id -> slab
        self.generators: dict[int, torch.Generator] = {}  # request_id -> its random stream
        self.num_prefill_tokens = self.num_decode_tokens = 0

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> tuple[dict[int, int], float]:
        """Run one step. Returns (request_id -> sampled token, the step's seconds)."""
        started = time.perf_counter()
        modelled = self.cost_model.step_time_of(output.scheduled) if self.cost_model else None
        for source, destination in output.blocks_to_copy:
            self.cache.copy_block(source, destination)
        sampled: dict[int, int] = {}
        # One new token on top of a cache: batched in one decode pass. Usually the newest output
        # token, but it can also be the last prompt token (a prefix hit or a chunk leaving one)
        # or a 1-token chunk inside the prompt: those are prefill tokens, and only a request
        # whose every token is now computed gets a token sampled.
        decodes = [r for r, n in output.scheduled if n == 1 and r.num_computed_tokens > 0]
        if decodes:
            logits = self._decode(decodes)
            for request, row in zip(decodes, logits):
                if request.num_computed_tokens >= request.prompt_len:
                    self.num_decode_tokens += 1   # an output token fed back
                else:
                    self.num_prefill_tokens += 1
                if request.num_computed_tokens + 1 == request.num_tokens:
                    self._sample(request, row, sampled)
        batched = {request.request_id for request in decodes}
        for request, num_new in output.scheduled:
            if request.request_id in batched:
                continue  # run in the decode pass above
            logits = self._forward_one(request, num_new)
            self.num_prefill_tokens += num_new
            if request.num_computed_tokens + num_new == request.num_tokens:
                self._sample(request, logits[-1], sampled)
        elapsed = time.perf_counter() - started
        return sampled, (modelled if modelled is not None else elapsed)

    def release(self, request: Request) -> None:
        """The request's memory was freed: finished (forget it) or preempted (keep its stream)."""
        slab = self.slab_of.pop(request.request_id, None)
        if slab is not None:
            self.cache.free_sequence(slab)
        if request.state is RequestState.FINISHED:
            self.generators.pop(request.request_id, None)

    # ---- sampling ------------------------------------------------------------------------------

    def _sample(self, request: Request, logits: torch.Tensor, sampled: dict[int, int]) -> None:
        """The next token of `request` (and the first of each of its forks) from one logits row."""
        sampled[request.request_id] = self._next_token(request, logits)
        for child in request.forks:  # the scheduler forks them from `request` in `update`
            if not self.paged:
                self.slab_of[child.request_id] = self.cache.fork_sequence(
                    self.slab_of[request.request_id])
            sampled[child.request_id] = self._next_token(child, logits)

    def _next_token(self, request: Request, logits: torch.Tensor) -> int:
        """Forced first token, else greedy, else a sample from the request's own stream."""
        params = request.sampling
        if request.num_output_tokens == 0 and params.first_token is not None:
            return params.first_token
        if params.temperature == 0:
            return int(logits.argmax())
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(params.stream_seed)
            self.generators[request.request_id] = generator
        return next_token(logits, params.temperature, generator)

    # ---- forward passes --------------------------------------------------------------------------

    def _forward_one(self, request: Request, num_new: int) -> torch.Tensor:
        """Tokens computed .. computed + num_new - 1 of one request, at their absolute positions.
        Returns logits [num_new, vocab_size]."""
        device = self.model.device
        start = request.num_computed_tokens
        ids = torch.tensor(request.token_ids(start, start + num_new), device=device)
        positions = torch.arange(start, start + num_new, device=device)
        return self.model(ids, positions, self._prefill_store(request, start, num_new))

    def _decode(self, batch: list[Request]) -> torch.Tensor:
        """One forward pass for the newest token of every decoding request, flat [num_seqs].
        Returns logits [num_seqs, vocab_size]."""
        device = self.model.device
        positions = [request.num_computed_tokens for request in batch]
        tokens = [request.token_ids(p, p + 1)[0] for request, p in zip(batch, positions)]
        return self.model(torch.tensor(tokens, device=device),
                          torch.tensor(positions, device=device),
                          self._decode_store(batch, positions))

    # ---- where the K/V live: the cache's KV stores (see `kvlab.model.KVStore`) ---------------

    def _prefill_store(self, request: Request, start: int, num_new: int):
        """The store for tokens start .. start + num_new - 1 of one request."""
        if self.paged:
            # The scheduler's manager reserved exactly these slots this step, so the table's
            # token count is start + num_new: the sequence length the store attends over.
            table = self.cache.manager.tables[request.request_id]
            slots = [table.slot(p) for p in range(start, start + num_new)]
            return self.cache.prefill_store(request.request_id,
                                            torch.tensor(slots, device=self.model.device))
        if request.request_id not in self.slab_of:
            self.slab_of[request.request_id] = self.cache.add_sequence()
        return self.cache.view(self.slab_of[request.request_id])

    def _decode_store(self, batch: list[Request], positions: list[int]):
        """The store for one new token of each request of `batch`, at `positions`."""
        if self.paged:
            tables = self.cache.manager.tables
            slots = [tables[r.request_id].slot(p) for r, p in zip(batch, positions)]
            return self.cache.decode_store([request.request_id for request in batch],
                                           torch.tensor(slots, device=self.model.device))
        return ContiguousDecodeStore(self.cache, [self.slab_of[r.request_id] for r in batch])


class ContiguousDecodeStore:
    """KV store for one new token of each of a batch of requests, each in its own slab.

    Writes token i's K/V at [slab_i, position_i] and attends it over its slab's first
    position_i + 1 tokens (the per-request loop is what a padded batched kernel would do).
    """

    def __init__(self, cache: ContiguousKVCache, slabs: list[int]):
        self.cache, self.slabs = cache, slabs

    def attend(self, layer_index, query, key, value, positions):
        cache, slabs = self.cache, torch.tensor(self.slabs, device=query.device)
        cache.k[layer_index, slabs, positions] = key
        cache.v[layer_index, slabs, positions] = value
        outputs = []
        for i, (slab, position) in enumerate(zip(self.slabs, positions.tolist())):
            keys = cache.k[layer_index, slab, :position + 1]
            values = cache.v[layer_index, slab, :position + 1]
            outputs.append(grouped_attention(query[i:i + 1], keys, values,
                                             query_positions=positions[i:i + 1]))
            if layer_index == cache.config.num_hidden_layers - 1:
                cache.seq_lens[slab] = position + 1
        return torch.cat(outputs)
