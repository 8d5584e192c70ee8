"""Simulation's stand-in tokens, read by the prefix cache block by block without building them.

A trace gives no token ids, only (for the Mooncake traces) the id of each 512-token prompt block.
Stage 7's simulation gives every token a stand-in id (`token_ids` below): token p of a prompt
whose trace block p // 512 has id h gets h x 512 + p % 512; prompt tokens past the named blocks
and every output token get the request's own id, -1 - request_id. Two blocks of the cache then
hold equal ids exactly where the trace says the prompts share them.

Building those ids costs a Python int per token, and hashing them (SHA-256 over 16 decimal ids
per block, `kvlab.prefix.block_hash`) several microseconds per block; the prompts of the whole
Mooncake conversation trace hold 9 million blocks of 16 tokens. `TraceBlocks` gives the prefix
cache the same blocks at a few ints each:

* content: the block's stand-in ids written as runs, (first id, length) per run, a run being
  consecutive ids (h x 512 + o, + 1, ...) or the request's own id repeated. Runs are maximal
  (a run that continues into the next trace block with the next id is merged), so the content is
  a function of the ids alone, and the ids can be read back from it (own ids are negative, trace
  ids >= 0): two blocks have equal contents exactly when they have equal stand-in ids. A block
  inside one trace block is one run: (h x 512 + o, block_size).
* hash: Python's built-in hash of (parent hash, content, extra keys), 64 bits and not
  collision-resistant. Enough here because the manager confirms every hit (verify=True, the
  default; `kvlab.prefix.prefix_cache`), so the cache finds exactly the blocks SHA-256 over the
  stand-in ids would (`tests/test_serving_trace_blocks.py` replays Mooncake slices both ways and
  compares every decision). Do not use it with verify=False, which trusts the hash alone.

Outputs are described by count only (they all carry the own id), so a request whose forks will
inherit its record keeps per-token stand-ins (`block_tokens`).

`block_tokens(request)` is how the prefix-caching manager reads any request: its real ids where
it has them (model mode), else these stand-ins.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Hashable

from .block_tokens import BlockTokens

if TYPE_CHECKING:
    from ..serving.request import Request

__all__ = ["TraceBlocks", "block_tokens", "token_ids"]


class TraceBlocks(BlockTokens):
    """A simulated request's tokens (prompt, then outputs so far) as compact block contents. The
    request's `trace_block_ids` name its first prompt blocks of `trace_block_size` tokens.
    ValueError for a negative id, or ids with trace_block_size < 1."""

    __slots__ = ("trace_ids", "trace_block_size", "named_end", "own_id", "prompt_len",
                 "num_tokens")

    def __init__(self, request: Request):
        trace_ids, size = request.trace_block_ids, request.trace_block_size
        if trace_ids and (size < 1 or min(trace_ids) < 0):
            raise ValueError(f"request {request.request_id}: trace block ids must be >= 0 with a "
                             f"trace_block_size >= 1, got ids from {min(trace_ids)} and "
                             f"trace_block_size={size}")
        self.trace_ids, self.trace_block_size = trace_ids, size
        # Tokens 0 .. named_end - 1 lie in blocks the trace names; the rest have the own id.
        self.named_end = min(request.prompt_len, len(trace_ids) * size)
        self.own_id = -1 - request.request_id
        self.prompt_len = request.prompt_len
        self.num_tokens = request.num_tokens

    def __len__(self) -> int:
        return self.num_tokens

    def block(self, index: int, block_size: int) -> tuple[int, ...]:
        """Runs of the stand-in ids of block `index`: (first id, length, first id, length, ...)."""
        return self.blocks(index, index + 1, block_size)[0]

    def blocks(self, start: int, stop: int, block_size: int) -> list[tuple[int, ...]]:
        """`block` of blocks start .. stop - 1 (one call for all the blocks a step fills)."""
        size, named_end, trace_ids = self.trace_block_size, self.named_end, self.trace_ids
        contents = []
        for index in range(start, stop):
            first, end = index * block_size, (index + 1) * block_size
            if end <= named_end and first // size == (end - 1) // size:  # the usual case
                contents.append((trace_ids[first // size] * size + first % size, block_size))
            elif first >= named_end:  # outputs, and prompts the trace names no block of (Azure)
                contents.append((self.own_id, block_size))
            else:
                contents.append(self._runs(first, end))
        return contents

    def _runs(self, start: int, end: int) -> tuple[int, ...]:
        """The maximal runs of tokens start .. end - 1, across trace blocks and into the own id."""
        size = self.trace_block_size
        runs: list[int] = []
        position = start
        while position < min(end, self.named_end):
            trace_index = position // size
            run_end = min(end, self.named_end, (trace_index + 1) * size)
            first = self.trace_ids[trace_index] * size + position % size
            if runs and runs[-2] + runs[-1] == first:  # the ids go on: one maximal run
                runs[-1] += run_end - position
            else:
                runs += [first, run_end - position]
            position = run_end
        if position < end:
            runs += [self.own_id, end - position]
        return tuple(runs)

    def block_hash(self, parent_hash: Hashable | None, content: tuple,
                   extra_keys: tuple[Hashable, ...], hash_fn=None) -> int:
        """Python's hash of (parent hash, content, extra keys); `hash_fn` unused (module: why)."""
        return self.chain_hashes(parent_hash, [content], extra_keys)[0]

    def chain_hashes(self, parent_hash: Hashable | None, contents: list[tuple],
                     extra_keys: tuple[Hashable, ...], hash_fn=None) -> list[int]:
        """`block_hash` of consecutive blocks, each the parent of the next."""
        hashes = []
        for content in contents:
            parent_hash = hash((parent_hash, content, extra_keys))
            hashes.append(parent_hash)
        return hashes

    def extend(self, token_ids: list[int]) -> None:
        """Append output tokens: own ids, after the whole prompt (ValueError otherwise)."""
        if self.num_tokens < self.prompt_len or token_ids.count(self.own_id) != len(token_ids):
            raise ValueError(f"a simulated request grows by output tokens with its own id "
                             f"{self.own_id} after its {self.prompt_len}-token prompt; got "
                             f"{list(token_ids)[:8]} at token {self.num_tokens}")
        self.num_tokens += len(token_ids)

    def copy(self) -> "TraceBlocks":
        return copy.copy(self)


def block_tokens(request: "Request") -> list[int] | BlockTokens:
    """All tokens of a request as the prefix cache reads them at admission: its ids (model mode, or
    a prompt given with ids), else `TraceBlocks`; a request with forks still to make gets per-token
    stand-ins, since each fork appends outputs under its own id."""
    if request.prompt_token_ids is not None or request.forks:
        return token_ids(request, 0, request.num_tokens)
    return TraceBlocks(request)


def token_ids(request: "Request", start: int, end: int) -> list[int]:
    """Ids of tokens start .. end - 1: real ids where known, else the module's stand-ins."""
    known = request.prompt_token_ids
    if known is not None:
        known = known + request.output_token_ids  # outputs are known in model mode only
        if end <= len(known):
            return known[start:end]
    own = -1 - request.request_id
    if known is None and start >= request.prompt_len:
        return [own] * (end - start)  # simulated outputs (most calls: one decode token)
    if known is not None:
        return known[start:end] + [own] * (end - max(start, len(known)))
    size, hashes = request.trace_block_size, request.trace_block_ids
    ids: list[int] = []
    position = start
    prompt_end = min(end, request.prompt_len)
    while position < prompt_end:
        block = position // size if hashes else len(hashes)
        if block < len(hashes):  # a block the trace names: ids shared with every prompt that has it
            block_end = min(prompt_end, (block + 1) * size)
            base = hashes[block] * size
            ids += range(base + position % size, base + position % size + block_end - position)
        else:
            block_end = prompt_end
            ids += [own] * (block_end - position)
        position = block_end
    return ids + [own] * (end - max(start, request.prompt_len))
