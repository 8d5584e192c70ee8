"""Stage 6 exercise: the block hash chain and the prefix lookup with the n - 1 cap.

Automatic prefix caching (vLLM's v1 KV cache manager; SGLang's RadixAttention does the same with a
radix tree) reuses the K/V of a prompt's prefix that an earlier request already computed. Its key
is the *block hash*: a fingerprint of a full block of `block_size` tokens **and of every token
before it**, built as a chain,

    hash(block 0) = SHA-256(ROOT_HASH   | tokens of block 0 | extra keys)
    hash(block i) = SHA-256(hash(i - 1) | tokens of block i | extra keys)

so equal hashes at block i mean equal prefixes up to the end of block i. Only full blocks have a
hash. Extra keys keep requests apart that must not share (a tenant's `cache_salt`).

You write, with no tensors:

* `hash_block`: one link of the chain, byte for byte as `kvlab.prefix.hash_block` computes it;
* `block_hashes`: the chain over a prompt's full blocks;
* `lookup`: how many leading tokens of a prompt a cache already holds, confirming each hit against
  the stored token ids (a hash collision must never hand out another prompt's K/V) and capped so
  that at least one prompt token is computed (its logits give the first output token).

`kvlab check 6` compares yours with `kvlab.prefix` on the same prompts. Read
`src/kvlab/prefix/` afterwards: `block_hash.py`, and `manager.py` for the real lookup (which also
checks each hit's parent block).

Units: token ids are ints; block_size is tokens per block; hashes are bytes (32 for SHA-256).
"""

from __future__ import annotations

import hashlib
from typing import Hashable, Mapping, Sequence

# The "parent hash" of block 0, the same constant as kvlab.prefix.ROOT_HASH.
ROOT_HASH = b"kvlab prefix-cache root"


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int],
               extra_keys: tuple[Hashable, ...] = ()) -> bytes:
    """SHA-256 digest of one full block, chained to its parent.

    The bytes hashed are, concatenated:

        parent (ROOT_HASH when parent_hash is None)
        b"|"
        the token ids in decimal, joined by commas, UTF-8     e.g. b"1,2,3,4"
        b"|"
        repr(tuple(extra_keys)), UTF-8                         e.g. b"()" or b"('salt', 'a')"

    Example: hash_block(None, [1, 2]) == hashlib.sha256(ROOT_HASH + b"|1,2|()").digest().

    Returns:
        the 32-byte digest.
    """
    # BEGIN SOLUTION hint: the bytes must follow the docstring's layout exactly, or no hash matches
    # hint: kvlab's; hashing the parent's digest in makes each hash name the whole prefix up to its
    # hint: block, and ROOT_HASH stands in for the first block's parent
    parent = ROOT_HASH if parent_hash is None else parent_hash
    payload = (parent + b"|" + ",".join(str(int(t)) for t in token_ids).encode()
               + b"|" + repr(tuple(extra_keys)).encode())
    return hashlib.sha256(payload).digest()
    # END SOLUTION


def block_hashes(token_ids: Sequence[int], block_size: int,
                 extra_keys: tuple[Hashable, ...] = ()) -> list[bytes]:
    """The hash chain of every *full* block of `token_ids` (a trailing partial block has none).

    Example: 10 tokens, block_size 4 -> 2 hashes: hash_block(None, tokens[0:4]), then
    hash_block(that, tokens[4:8]). Tokens 8 and 9 are not a full block.

    Raises:
        ValueError: block_size < 1 (the message names it).
    """
    # BEGIN SOLUTION hint: only full blocks get a hash; each block's parent is the previous block's
    # hint: hash (the first has none), so equal hashes mean equal prefixes; refuse block_size < 1
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
    # END SOLUTION


def lookup(token_ids: Sequence[int], block_size: int, cache: Mapping[bytes, tuple[int, ...]],
           extra_keys: tuple[Hashable, ...] = ()) -> int:
    """How many leading tokens of a prompt the cache holds: the prefix cache hit, in tokens.

    `cache` maps a block hash to the token ids stored in that block. Walk the prompt's full blocks
    from block 0: block i is a hit when its hash is in the cache AND the stored tokens equal the
    block's tokens (a hash collision must count as a miss); stop at the first miss. Take at most
    (len(token_ids) - 1) // block_size blocks, so at least one prompt token is always computed.

    Example: block_size 4, the cache holds the blocks of [1..8]: lookup of [1..8] + [9] is 8;
    lookup of [1..8] itself is 4 (the cap); lookup of [0, 2, 3, 4, 5, ...] is 0.

    Returns:
        the hit in tokens (a multiple of block_size).

    Raises:
        ValueError: block_size < 1, or an empty prompt.
    """
    # BEGIN SOLUTION hint: walk the chain from block 0 and stop at the first miss: a hash the cache
    # hint: lacks, or one whose stored tokens differ (a collision must not serve another prompt's
    # hint: K/V); the cap leaves the last prompt token to compute, since its logits give the first
    # hint: output token
    if not token_ids:
        raise ValueError("an empty prompt has nothing to look up")
    cap = (len(token_ids) - 1) // block_size
    hits = 0
    for index, block_hash in enumerate(block_hashes(token_ids, block_size, extra_keys)[:cap]):
        tokens = tuple(token_ids[index * block_size:(index + 1) * block_size])
        if cache.get(block_hash) != tokens:
            break
        hits += 1
    return hits * block_size
    # END SOLUTION
