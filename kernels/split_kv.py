"""How many splits a split-KV (flash-decoding) launch uses: host arithmetic, no Triton.

In decode, one program handles one KV head of one sequence (`kvlab.kernels.paged_attention`), so a
launch has num_seqs x num_kv_heads programs. A few long sequences give too few programs to fill the
card: 1 sequence x 8 KV heads is 8 programs on a GPU with 132 multiprocessors, 124 of them idle
while each program walks 32,000 tokens alone. Flash-decoding (Dao, Haziza, Massa, Sizov,
"Flash-Decoding for long-context inference", 2023) cuts each sequence's tokens into splits that
run in parallel, each producing a partial output and the log-sum-exp of its scores; a small reduce
step combines them exactly (the same rescaling as the online softmax).
"""

from __future__ import annotations

__all__ = ["choose_num_splits", "tokens_per_split", "MIN_TOKENS_PER_SPLIT", "MAX_SPLITS"]

# A floor on a split's length, so that its start-up and its share of the reduce stay small next to
# the tokens it reads. 256 is a choice, not a measured optimum.
MIN_TOKENS_PER_SPLIT = 256
# The reduce kernel holds all splits of one head in one tile.
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
                      max_splits: int = MAX_SPLITS) -> int:
    """Splits per sequence so that every multiprocessor (num_sms) gets a program: 1 when
    num_seqs * num_kv_heads already fills the card, else ceil(num_sms / programs), capped by
    max_seq_len // min_tokens_per_split and max_splits. ValueError: a count below 1."""
    for name, value in dict(num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len,
                            num_sms=num_sms, min_tokens_per_split=min_tokens_per_split,
                            max_splits=max_splits).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = -(-num_sms // programs)
    allowed_by_length = max(1, max_seq_len // min_tokens_per_split)
    return max(1, min(wanted, allowed_by_length, max_splits))


def tokens_per_split(max_seq_len: int, num_splits: int, tile: int) -> int:
    """n, an equal share of the longest sequence rounded up to whole tiles: split s covers
    [s * n, min(seq_len, (s + 1) * n)); a shorter sequence's last splits are empty (weight 0)."""
    if num_splits < 1 or tile < 1 or max_seq_len < 1:
        raise ValueError(f"need max_seq_len, num_splits, tile >= 1, got {max_seq_len}, "
                         f"{num_splits}, {tile}")
    share = -(-max_seq_len // num_splits)
    return -(-share // tile) * tile
