"""A sequence's tokens as the prefix cache reads them: block by block.

The prefix-caching manager needs each full block's *content* (what the exact check in
`PrefixCache.find` compares) and its chained *hash* (`block_hash`); it keeps one `BlockTokens` per
sequence. `TokenIds` holds real ids; `kvlab.prefix.trace_blocks.TraceBlocks` describes a trace's
blocks compactly for stage 7's simulation (one trace block id for hundreds of tokens).
"""

from __future__ import annotations

import abc
from typing import Hashable, Iterable, Sequence

from .block_hash import HashFunction, hash_block

__all__ = ["BlockTokens", "TokenIds", "as_block_tokens"]


class BlockTokens(abc.ABC):
    """The tokens of one sequence, seen as full blocks (a trailing partial block has no content)."""

    __slots__ = ()

    @abc.abstractmethod
    def __len__(self) -> int:
        """Tokens in the sequence."""

    @abc.abstractmethod
    def block(self, index: int, block_size: int) -> tuple:
        """Full block `index`'s content: equal exactly where two sequences' tokens are."""

    def blocks(self, start: int, stop: int, block_size: int) -> list[tuple]:
        """`block` of each of blocks start .. stop - 1."""
        return [self.block(index, block_size) for index in range(start, stop)]

    @abc.abstractmethod
    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens (a decode step's output)."""

    @abc.abstractmethod
    def copy(self) -> "BlockTokens":
        """An independent copy (a fork, or the manager's own record of a caller's sequence)."""

    def block_hash(self, parent_hash: Hashable | None, content: tuple,
                   extra_keys: tuple[Hashable, ...], hash_fn: HashFunction) -> Hashable:
        """Chained hash of a block of this content (`hash_block`)."""
        return hash_block(parent_hash, content, extra_keys, hash_fn)

    def chain_hashes(self, parent_hash: Hashable | None, contents: list[tuple],
                     extra_keys: tuple[Hashable, ...], hash_fn: HashFunction) -> list[Hashable]:
        """`block_hash` of consecutive blocks, each the parent of the next."""
        hashes = []
        for content in contents:
            parent_hash = self.block_hash(parent_hash, content, extra_keys, hash_fn)
            hashes.append(parent_hash)
        return hashes


class TokenIds(BlockTokens):
    """Real token ids; a block's content is the tuple of its block_size ids (ints)."""

    __slots__ = ("ids",)

    def __init__(self, token_ids: Iterable[int]):
        self.ids = list(map(int, token_ids))  # int(): numpy / torch integers become plain ints

    def __len__(self) -> int:
        return len(self.ids)

    def block(self, index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.ids[index * block_size:(index + 1) * block_size])

    def extend(self, token_ids: Sequence[int]) -> None:
        self.ids.extend(map(int, token_ids))

    def copy(self) -> "TokenIds":
        return TokenIds(self.ids)


def as_block_tokens(token_ids: Sequence[int] | BlockTokens) -> BlockTokens:
    """A fresh `BlockTokens` of the argument: a copy of a `BlockTokens`, else `TokenIds`."""
    return token_ids.copy() if isinstance(token_ids, BlockTokens) else TokenIds(token_ids)

