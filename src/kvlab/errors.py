"""The errors of the KV caches and the requests they serve, one class per way a server reacts:

* `KVCacheOutOfMemory`: the cache cannot be set up or grow (a slab over budget in stage 2, a pool
  that cannot hold one max_model_len request, a budget below the weights in stage 4).
* `NoFreeBlocksError` (a `KVCacheOutOfMemory`): the pool is dry *right now*; the scheduler preempts
  (Kwon et al., SOSP 2023, section 4.5) or waits, then retries. Nothing changed.
* `RequestTooLongError` (a `ValueError`): can *never* fit (past max_model_len or the whole pool);
  waiting would block the queue forever, so it is rejected at once.
* `SizingError` (a `ValueError`): stage 0's arithmetic was asked for a size that makes no sense
  (an unknown GPU or dtype, an impossible tensor parallelism, a length past any deployment).

Bad arguments raise the built-in `ValueError` / `KeyError` with the value; a failed call changes no
state. No kvlab imports here, so every stage imports this module without a cycle.
"""

from __future__ import annotations

__all__ = ["KVCacheOutOfMemory", "NoFreeBlocksError", "RequestTooLongError", "SizingError"]


class KVCacheOutOfMemory(MemoryError):
    """The KV cache cannot be reserved or cannot grow; the message gives the arithmetic."""


class NoFreeBlocksError(KVCacheOutOfMemory):
    """Fewer free blocks than asked for at this moment; no state was changed (retry after freeing)."""


class RequestTooLongError(ValueError):
    """A request that can never fit (max_model_len or the whole pool); the message gives the numbers."""


class SizingError(ValueError):
    """A request for a size that makes no sense (the message names the value)."""
