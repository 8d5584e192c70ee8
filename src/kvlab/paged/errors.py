"""The two ways a paged KV cache says no.

They are different on purpose, because a server must react to them differently:

* `NoFreeBlocksError`: the block pool has run dry *right now*. The request is fine; it will fit once
  other sequences finish. The scheduler preempts a sequence (vLLM paper, Kwon et al., SOSP 2023,
  section 4.5) or waits, then retries. Nothing changed when it was raised.
* `RequestTooLongError`: the request can *never* fit: it is longer than max_model_len, or needs more
  blocks than the whole pool has. Waiting would block the queue forever, so it is rejected at once.

Start-up failures (the pool cannot hold one max_model_len request, the memory budget is smaller
than the weights) raise `KVCacheOutOfMemory`, the same error the contiguous cache of stage 2 raises.
"""

from __future__ import annotations

from ..contiguous import KVCacheOutOfMemory

__all__ = ["KVCacheOutOfMemory", "NoFreeBlocksError", "RequestTooLongError"]


class NoFreeBlocksError(KVCacheOutOfMemory):
    """Fewer free blocks than asked for at this moment; no state was changed (retry after freeing)."""


class RequestTooLongError(ValueError):
    """A request that can never fit (max_model_len or the whole pool); the message gives the numbers."""
