"""A sequence's tokens as the prefix cache reads them: block by block.

The prefix-caching manager needs two things of every full block of a sequence: its *content*, the
value the exact check compares (`PrefixCache.find`), and its *hash*, chained through the parent
block's hash (`block_hash`). `BlockTokens` is that view. The manager keeps one per sequence and
grows it as tokens are appended.

* `TokenIds` holds real token ids (model mode, the engine, the notebooks): a block's content is its
  block_size ids, hashed with the manager's hash function (SHA-256 by default, `hash_block`).
* A trace replay without token ids can describe the same contents more compactly (one trace block
  id stands for hundreds of tokens); `kvlab.prefix.trace_blocks.TraceBlocks` does that for
  stage 7's simulation mode, with contents equal exactly where the stand-in ids would be equal.
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
        """Content of full block `index` (tokens index * block_size .. + block_size - 1): equal
        for two sequences exactly when their tokens there are equal."""

    @abc.abstractmethod
    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens (a decode step's output)."""

    @abc.abstractmethod
    def copy(self) -> "BlockTokens":
        """An independent copy (a fork, or the manager's own record of a caller's sequence)."""

    def block_hash(self, parent_hash: Hashable | None, content: tuple,
                   extra_keys: tuple[Hashable, ...], hash_fn: HashFunction) -> Hashable:
        """Chained hash of a block whose content is `content` (see `block_hash.hash_block`)."""
        return hash_block(parent_hash, content, extra_keys, hash_fn)


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

