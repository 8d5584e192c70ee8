"""Stage 2 exercise: the naive contiguous KV cache, and what it wastes.

A naive server reserves, at start-up, one slab per request slot (`max_num_seqs` of them), each
big enough for `max_model_len` tokens, whatever each request will really use. You write:

* `check_reservation`: the start-up check. It refuses a reservation that does not fit, with the
  arithmetic in the error message, so the operator sees *why* (the story's start-up OOM).
* `write_kv`: store one step's keys (or values) at their token positions in a request's slab.
* `reserved_bytes`, `used_bytes`, `waste`: the memory accounting that shows most of a slab
  holds nothing (the vLLM paper measured only 20.4-38.2 % of such reservations in use).

`kvlab check 2` compares yours with `kvlab.contiguous.ContiguousKVCache`; read
`src/kvlab/contiguous.py` afterwards and compare.

Layout of one request's slab, for one layer and one of K or V:
[max_model_len, num_key_value_heads, head_dim]; the token at position p lives at `slab[p]`.
Units: bytes are whole numbers of bytes; token counts and positions are ints.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvlab.sizing import format_bytes


def check_reservation(max_num_seqs: int, max_model_len: int, bytes_per_token: int,
                      budget_bytes: int) -> int:
    """Bytes a naive server reserves up front, refused when they exceed the memory budget.

        reservation = max_num_seqs x max_model_len x bytes_per_token

    Args:
        max_num_seqs: request slots (slabs) reserved.
        max_model_len: tokens per slab (prompt + generated).
        bytes_per_token: KV bytes of one token over all layers (stage 0's `kv_bytes_per_token`).
        budget_bytes: memory available for the KV cache, in bytes.

    Returns:
        The reservation in bytes (int), when it is <= budget_bytes.

    Raises:
        ValueError: max_num_seqs or max_model_len < 1.
        MemoryError: the reservation exceeds budget_bytes. The message shows the arithmetic with
            `kvlab.sizing.format_bytes` for the byte figures, e.g.
            "KV cache reservation 128 seqs x 4096 tokens x 128 KiB/token = 64 GiB > 40 GiB budget".
    """
    # BEGIN SOLUTION hint: a contiguous cache reserves every slab up front, max_model_len tokens
    # hint: each, whatever the requests will use; check the counts, then refuse a reservation above
    # hint: the budget (MemoryError showing the docstring's arithmetic)
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    wanted = max_num_seqs * max_model_len * bytes_per_token
    if wanted > budget_bytes:
        raise MemoryError(
            f"KV cache reservation {max_num_seqs} seqs x {max_model_len} tokens x "
            f"{format_bytes(bytes_per_token)}/token = {format_bytes(wanted)} > "
            f"{format_bytes(budget_bytes)} budget")
    return wanted
    # END SOLUTION


def write_kv(slab: torch.Tensor, positions: torch.Tensor, k: torch.Tensor) -> None:
    """Store new keys (or values) in a request's slab, in place, each at its token's position.

    Prefill writes the whole prompt at positions 0 .. P-1; each decode step writes one token at
    the next position. Positions already written are overwritten; nothing else changes.

    Args:
        slab: [max_model_len, num_key_value_heads, head_dim], modified in place.
        positions: [num_tokens] int64, absolute position of each new token.
        k: [num_tokens, num_key_value_heads, head_dim], same dtype as slab.

    Raises:
        MemoryError: a position is >= max_model_len (the slab has no room for it; nothing is
            written). The message names the position and max_model_len.
    """
    # BEGIN SOLUTION hint: a slab never grows: a position past its end is out of memory; refuse
    # hint: before writing anything, so a failed call leaves the slab as it was
    max_model_len = slab.shape[0]
    if len(positions) and int(positions.max()) >= max_model_len:
        raise MemoryError(f"position {int(positions.max())} is past the slab's "
                          f"max_model_len={max_model_len}")
    slab[positions] = k
    # END SOLUTION


def reserved_bytes(*tensors: torch.Tensor) -> int:
    """Exact bytes the given cache tensors occupy (all of them, whether they hold tokens or not).

    Count, never estimate: elements x bytes per element, summed over the tensors.

    Args:
        tensors: the cache's tensors, e.g. `reserved_bytes(cache.k, cache.v)`.

    Returns:
        Bytes (int).
    """
    # BEGIN SOLUTION hint: what the tensors occupy, filled or not: every element costs its dtype's
    # hint: bytes
    return sum(t.numel() * t.element_size() for t in tensors)
    # END SOLUTION


def used_bytes(seq_lens: Sequence[int], bytes_per_token: int) -> int:
    """Bytes of the cache that hold token states: every token held, by every slab.

    Args:
        seq_lens: tokens each slab holds now (0 for a free slab).
        bytes_per_token: KV bytes of one token over all layers.

    Returns:
        Bytes (int).
    """
    # BEGIN SOLUTION hint: only the tokens the slabs really hold count, bytes_per_token each
    return sum(seq_lens) * bytes_per_token
    # END SOLUTION


def waste(used: int, reserved: int) -> float:
    """Fraction of the reservation that holds no token state: 1 - used / reserved.

    0.0 means every reserved byte holds a token; 0.95 means 95 % of the memory is wasted.

    Args:
        used: bytes holding token states (`used_bytes`).
        reserved: bytes reserved (`reserved_bytes`).

    Returns:
        A float in [0, 1].

    Raises:
        ValueError: reserved <= 0, or used outside [0, reserved].
    """
    # BEGIN SOLUTION hint: 1 - used / reserved, after refusing impossible inputs with ValueError
    if reserved <= 0:
        raise ValueError(f"reserved must be a positive number of bytes, got {reserved}")
    if not 0 <= used <= reserved:
        raise ValueError(f"used={used} bytes must lie in [0, reserved={reserved}]")
    return 1 - used / reserved
    # END SOLUTION
