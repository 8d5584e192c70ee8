"""Block hashes: a fingerprint of a full block *and of everything before it*.

Two requests may share the K/V of a block only if they agree on every token up to the end of that
block, because attention at position p reads every earlier position. So the key of block i cannot
be its own tokens alone; it must stand for the whole prefix. Chaining does that in constant work
per block:

    hash(block 0) = H(ROOT,            tokens of block 0, extra keys)
    hash(block i) = H(hash(block i-1), tokens of block i, extra keys)

Equal hashes at block i mean (barring a collision of H) equal prefixes up to the end of block i.
This is the design of vLLM's v1 KV cache manager ("automatic prefix caching": only full blocks are
hashed, the parent block's hash goes into the child's). H is SHA-256 by default, as in vLLM's
`sha256` prefix-caching hash option; `hash_fn` lets a test put in a deliberately weak one.

Extra keys are whatever besides the tokens changes the K/V or must keep requests apart. Here that
is `cache_salt`: two tenants with equal prompts and different salts get different hashes at every
block, so they share nothing. (vLLM mixes the salt into the first block only and lets the chain
carry it; putting it into every block is simpler to read and costs nothing measurable.)

Only *full* blocks get a hash: a partly filled block will still receive tokens, so its content,
and with it its key, is not final.
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
    """The extra keys of a request's blocks: () without a salt, ('salt', cache_salt) with one.

    Raises:
        TypeError: cache_salt is neither None nor a str.
    """
    if cache_salt is None:
        return ()
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
    return ("salt", cache_salt)


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int],
               extra_keys: tuple[Hashable, ...] = (), hash_fn: HashFunction = sha256) -> BlockHash:
    """Hash of one full block: H(parent hash, token ids, extra keys).

    Args:
        parent_hash: hash of the previous block of the same sequence; None for block 0.
        token_ids: the block's block_size token ids (ints).
        extra_keys: e.g. `extra_keys_for(cache_salt)`; must have a stable repr.
        hash_fn: bytes -> bytes (default SHA-256).

    Returns:
        the digest (bytes; 32 bytes for SHA-256).
    """
    parent = ROOT_HASH if parent_hash is None else parent_hash
    # Decimal ids joined by commas and a '|' between the three parts: the encoding is unambiguous,
    # so with a strong H only equal (parent, tokens, extra keys) give equal hashes.
    payload = (parent + b"|" + ",".join(map(str, map(int, token_ids))).encode()
               + b"|" + repr(tuple(extra_keys)).encode())
    return hash_fn(payload)


def hash_full_blocks(token_ids: Sequence[int], block_size: int,
                     extra_keys: tuple[Hashable, ...] = (), hash_fn: HashFunction = sha256,
                     parent_hash: BlockHash | None = None) -> list[BlockHash]:
    """The chain of hashes of every full block of `token_ids` (a trailing partial block has none).

    Args:
        token_ids: the sequence's tokens, from position 0 (or from the block after `parent_hash`).
        block_size: tokens per block.
        extra_keys, hash_fn: see `hash_block`.
        parent_hash: hash of the block before token_ids[0] (None: token_ids starts the sequence).

    Returns:
        len(token_ids) // block_size hashes, block 0 first.

    Raises:
        ValueError: block_size < 1.
    """
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
