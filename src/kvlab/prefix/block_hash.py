"""Block hashes: a fingerprint of a full block *and of everything before it*.

Two requests may share a block's K/V only if they agree on every token up to its end (attention at
p reads every earlier position), so block i's key must stand for the whole prefix. Chaining does
that in constant work per block:

    hash(block 0) = H(ROOT,            tokens of block 0, extra keys)
    hash(block i) = H(hash(block i-1), tokens of block i, extra keys)

Equal hashes at block i mean (barring a collision) equal prefixes through block i: vLLM v1's
automatic prefix caching. H is SHA-256 by default, as vLLM's `sha256` option; `hash_fn` lets a test
use a weak one. Only *full* blocks are hashed: a partial block's content is not final. The extra
key is `cache_salt`: tenants with different salts share nothing. (vLLM mixes it into the first
block only and lets the chain carry it; every block is simpler to read and costs nothing.)
"""

from __future__ import annotations

import hashlib
from typing import Callable, Hashable, Sequence

__all__ = ["BlockHash", "HashFunction", "ROOT_HASH", "sha256", "extra_keys_for", "hash_block",
           "hash_full_blocks", "short"]

BlockHash = bytes
HashFunction = Callable[[bytes], bytes]

# The "parent hash" of block 0. Fixed (not random per process) so a notebook's hashes are
# reproducible; vLLM seeds it from PYTHONHASHSEED for the same reason.
ROOT_HASH: BlockHash = b"kvlab prefix-cache root"


def sha256(data: bytes) -> BlockHash:
    """SHA-256 digest of `data` (32 bytes). The default block hash function."""
    return hashlib.sha256(data).digest()


def extra_keys_for(cache_salt: str | None) -> tuple[Hashable, ...]:
    """() without a salt, ('salt', cache_salt) with one; TypeError unless None or a str."""
    if cache_salt is None:
        return ()
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
    return ("salt", cache_salt)


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int],
               extra_keys: tuple[Hashable, ...] = (), hash_fn: HashFunction = sha256) -> BlockHash:
    """H(parent hash (None for block 0), the block's token ids, extra keys (a stable repr))."""
    parent = ROOT_HASH if parent_hash is None else parent_hash
    # Decimal ids joined by commas and a '|' between the three parts: the encoding is unambiguous,
    # so with a strong H only equal (parent, tokens, extra keys) give equal hashes.
    payload = (parent + b"|" + ",".join(map(str, map(int, token_ids))).encode()
               + b"|" + repr(tuple(extra_keys)).encode())
    return hash_fn(payload)


def hash_full_blocks(token_ids: Sequence[int], block_size: int,
                     extra_keys: tuple[Hashable, ...] = (), hash_fn: HashFunction = sha256,
                     parent_hash: BlockHash | None = None) -> list[BlockHash]:
    """len(token_ids) // block_size chained hashes, continuing from `parent_hash` (None: from
    position 0). ValueError: block_size < 1."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size], extra_keys,
                                 hash_fn)
        hashes.append(parent_hash)
    return hashes


def short(block_hash: Hashable) -> str:
    """First 8 hex digits of a bytes hash (for printing); str() of anything else."""
    return block_hash.hex()[:8] if isinstance(block_hash, bytes) else str(block_hash)
