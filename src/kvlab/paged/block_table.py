"""A block table: one sequence's map from logical blocks to physical blocks.

Token at position p lives in logical block p // block_size, at offset p % block_size. The block
table says which physical block of the pool that logical block is (vLLM paper, Kwon et al., SOSP
2023, section 4.2, figure 6). Its slot, the row of the flattened pool
[num_blocks * block_size, num_key_value_heads, head_dim], is

    slot = block_id * block_size + offset

so a sequence's tokens can sit in any blocks, in any order, and only its last block is ever
partly empty: the waste is under one block per sequence (section 4.2), instead of a whole
max_model_len reservation (stage 2).
"""

from __future__ import annotations

import dataclasses

__all__ = ["BlockTable", "cdiv"]


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: blocks needed for `numerator` tokens of `denominator` per block."""
    return -(-numerator // denominator)


@dataclasses.dataclass
class BlockTable:
    """One sequence's physical block ids in logical order (entry i holds positions
    i * block_size .. (i + 1) * block_size - 1) and `num_tokens`, the positions reserved."""

    block_size: int
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0

    def slot(self, position: int) -> int:
        """Slot of the token at `position`; IndexError if negative or it has no block yet."""
        if not 0 <= position < len(self.block_ids) * self.block_size:
            raise IndexError(f"position {position} is outside the {len(self.block_ids)} blocks "
                             f"of {self.block_size} slots this table holds")
        block_id = self.block_ids[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def num_blocks_after(self, num_new_tokens: int) -> int:
        """New blocks needed to hold `num_new_tokens` (>= 0, else ValueError) more tokens."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.block_ids)

    def tokens_in_block(self, index: int) -> int:
        """Tokens held by logical block `index` (block_size for all but maybe the last)."""
        return min(self.block_size, self.num_tokens - index * self.block_size)
