"""The errors of the KV caches and the requests they serve, in one place every stage imports.

A server must react to each differently, so they are different classes:

* `KVCacheOutOfMemory`: the cache cannot be set up or cannot grow: a contiguous reservation larger
  than the budget (stage 2), a block pool that cannot hold one max_model_len request, a memory
  budget smaller than the weights (stage 4). The message gives the arithmetic.
* `NoFreeBlocksError` (a `KVCacheOutOfMemory`): the block pool has run dry *right now*. The request
  is fine; it will fit once other sequences finish. The scheduler preempts a sequence (vLLM paper,
  Kwon et al., SOSP 2023, section 4.5) or waits, then retries. Nothing changed when it was raised.
* `RequestTooLongError` (a `ValueError`): a request that can *never* fit: longer than
  max_model_len, or needing more blocks than the whole pool has. Waiting would block the queue
  forever, so it is rejected at once.

Bad arguments (a negative count, an unknown id, a limit above the model's) raise the built-in
`ValueError` / `KeyError` with the value in the message; a failed call changes no state.

This module imports nothing from kvlab, so any stage can import it without a cycle.
"""

from __future__ import annotations

__all__ = ["KVCacheOutOfMemory", "NoFreeBlocksError", "RequestTooLongError"]


class KVCacheOutOfMemory(MemoryError):
    """The KV cache cannot be reserved or cannot grow; the message gives the arithmetic."""


class NoFreeBlocksError(KVCacheOutOfMemory):
    """Fewer free blocks than asked for at this moment; no state was changed (retry after freeing)."""


class RequestTooLongError(ValueError):
    """A request that can never fit (max_model_len or the whole pool); the message gives the numbers."""
