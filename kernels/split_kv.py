"""How many splits a split-KV (flash-decoding) launch uses: host arithmetic, no Triton.

In decode, one program handles one KV head of one sequence (`kvlab.kernels.paged_attention`), so a
launch has num_seqs x num_kv_heads programs. A few long sequences give too few programs to fill the
card: 1 sequence x 8 KV heads is 8 programs on a GPU with 132 multiprocessors, 124 of them idle
while each program walks 32,000 tokens alone. Flash-decoding (Dao, Haziza, Massa, Sizov,
"Flash-Decoding for long-context inference", 2023) cuts each sequence's tokens into splits that
run in parallel, each producing a partial output and the log-sum-exp of its scores; a small reduce
step combines them exactly (the same rescaling as the online softmax).

**Resident programs and waves.** One program per multiprocessor (SM) is not enough either: a
program waits for its loads most of the time, and an SM keeps the memory bus busy only with several
programs resident at once, as many as its registers, shared memory and warp slots allow
(`resident_programs`; limits of compute capability 9.0, H100/H200, from the CUDA C++ Programming
Guide's technical specifications). The heuristic aims at PROGRAMS_PER_SM resident programs on
every SM. Programs beyond that wait for a second **wave**, and a partly filled wave leaves SMs too
few programs to keep enough loads in flight: so splitting stops where the programs would spill
past one wave (`choose_num_splits`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["choose_num_splits", "tokens_per_split", "resident_programs", "SmLimits", "SM90",
           "PROGRAMS_PER_SM", "MIN_TOKENS_PER_SPLIT", "MAX_SPLITS"]

# A floor on a split's length, so that its start-up and its share of the reduce stay small next to
# the tokens it reads. 256 is a choice, not a measured optimum.
MIN_TOKENS_PER_SPLIT = 256
# The reduce kernel holds all splits of one head in one tile.
MAX_SPLITS = 64
# Resident programs per SM the splits aim at. The decode kernel compiled for sm_90 at
# batch 64 x 4,096 tokens (<= 128 registers, tests/test_triton_compile.py) fits at least 4.
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class SmLimits:
    """What one multiprocessor holds at once (CUDA C++ Programming Guide, technical specifications
    per compute capability; the 256-register allocation unit per warp is the CUDA occupancy
    calculator's)."""

    registers: int
    register_unit: int  # registers are given to a warp in multiples of this
    warps: int
    blocks: int
    shared_bytes: int
    reserved_shared_per_block: int  # what CUDA keeps of shared memory for each resident block


SM90 = SmLimits(registers=65_536, register_unit=256, warps=64, blocks=32,
                shared_bytes=228 * 1024, reserved_shared_per_block=1024)


def resident_programs(registers: int, shared_bytes: int, num_warps: int,
                      limits: SmLimits = SM90) -> int:
    """Programs (thread blocks) of num_warps warps that fit on one SM at once, given a compiled
    kernel's registers per thread and shared memory per program (bytes, the static and dynamic
    amounts added); the least of what registers, shared memory, warp and block slots allow.
    ValueError: registers or num_warps below 1, shared_bytes below 0."""
    if registers < 1 or num_warps < 1 or shared_bytes < 0:
        raise ValueError(f"need registers, num_warps >= 1 and shared_bytes >= 0, got {registers}, "
                         f"{num_warps}, {shared_bytes}")
    per_warp = -(-registers * 32 // limits.register_unit) * limits.register_unit
    by_registers = limits.registers // (per_warp * num_warps)
    by_shared = limits.shared_bytes // (shared_bytes + limits.reserved_shared_per_block)
    return min(by_registers, by_shared, limits.warps // num_warps, limits.blocks)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM,
                      min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
                      max_splits: int = MAX_SPLITS) -> int:
    """Splits per sequence: the most that keep num_seqs x num_kv_heads x splits programs within
    one wave of num_sms x programs_per_sm, capped by max_seq_len // min_tokens_per_split and
    max_splits; 1 when the programs fill a wave already. ValueError: a count below 1."""
    for name, value in dict(num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len,
                            num_sms=num_sms, programs_per_sm=programs_per_sm,
                            min_tokens_per_split=min_tokens_per_split,
                            max_splits=max_splits).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    one_wave = num_sms * programs_per_sm  # programs that run at once
    fitting = one_wave // (num_seqs * num_kv_heads)  # splits before a second wave starts
    allowed_by_length = max_seq_len // min_tokens_per_split
    return max(1, min(fitting, allowed_by_length, max_splits))


def tokens_per_split(max_seq_len: int, num_splits: int, tile: int) -> int:
    """n, an equal share of the longest sequence rounded up to whole tiles: split s covers
    [s * n, min(seq_len, (s + 1) * n)); a shorter sequence's last splits are empty (weight 0)."""
    if num_splits < 1 or tile < 1 or max_seq_len < 1:
        raise ValueError(f"need max_seq_len, num_splits, tile >= 1, got {max_seq_len}, "
                         f"{num_splits}, {tile}")
    share = -(-max_seq_len // num_splits)
    return -(-share // tile) * tile
