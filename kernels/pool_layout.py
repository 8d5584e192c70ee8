"""The two physical layouts of a block pool, and which addresses one attention program reads.

One layer's pool holds `num_blocks` blocks of `block_size` token slots, in one of two axis orders:

* token-major `[num_blocks, block_size, num_kv_heads, head_dim]`: what stage 4 allocates; the slot
  mapping indexes its flat `[num_blocks * block_size, num_kv_heads, head_dim]` view.
* head-major `[num_blocks, num_kv_heads, block_size, head_dim]`: FlashInfer's "HND" order, one
  KV head of a block stored together. vLLM's original PagedAttention kernel (Kwon et al., SOSP
  2023) also kept a block's KV head together, but with the dimension before the token (its value
  cache `[num_blocks, num_kv_heads, head_size, block_size]`), so neither layout here is its order.

One decode program reads one KV head of one sequence. Token-major, that head's vectors in a block
are `num_kv_heads * head_dim` elements apart (`block_size` runs of `head_dim`); head-major, they
are one run of `block_size * head_dim`. Runs are not what a GPU fetches, though: a warp's loads
are served in 32-byte sectors (CUDA C++ Best Practices Guide, "Coalesced Access to Global
Memory"), and a row of whole sectors (head_dim 128 in bf16: 256 bytes) costs the same sectors in
either layout. The layout counts only for rows shorter than a sector (notebook 05c, section 2,
which on a GPU also times both layouts); stage 5's benchmark (`kvlab.tools.bench_paged_attention`)
times what it is worth in GB/s.
No Triton here: the notebook's CPU picture uses this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TOKEN_MAJOR", "HEAD_MAJOR", "LAYOUTS", "check_layout", "pool_shape", "pool_strides",
           "program_addresses", "contiguous_runs", "RunStats", "run_stats", "plot_program_reads"]

TOKEN_MAJOR = "token-major"
HEAD_MAJOR = "head-major"
LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)


def check_layout(layout: str) -> str:
    """Return `layout` if it names a known pool layout; ValueError listing both otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown pool layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return layout


def pool_shape(layout: str, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int) -> tuple[int, int, int, int]:
    """The 4-d shape of one layer's K (or V) pool; ValueError: unknown layout, a size < 1."""
    check_layout(layout)
    sizes = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if layout == TOKEN_MAJOR:
        return (num_blocks, block_size, num_kv_heads, head_dim)
    return (num_blocks, num_kv_heads, block_size, head_dim)


def pool_strides(pool: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """Element strides by meaning, (block, token slot, KV head, dim): one kernel, either layout.
    ValueError: unknown layout or a pool that is not 4-d."""
    check_layout(layout)
    if pool.dim() != 4:
        raise ValueError(f"a pool is 4-d, got shape {tuple(pool.shape)}")
    s_block, s1, s2, s_dim = pool.stride()
    if layout == TOKEN_MAJOR:
        return s_block, s1, s2, s_dim
    return s_block, s2, s1, s_dim


def program_addresses(layout: str, block_table: list[int], seq_len: int, kv_head: int,
                      block_size: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """Element offsets (not bytes) one program reads for K (or V), in read order. ValueError:
    unknown layout, a head out of range, or a block table too short for seq_len."""
    check_layout(layout)
    if not 0 <= kv_head < num_kv_heads:
        raise ValueError(f"kv_head {kv_head} out of range for {num_kv_heads} KV heads")
    if seq_len > len(block_table) * block_size:
        raise ValueError(f"seq_len {seq_len} needs more than the {len(block_table)} blocks of "
                         f"{block_size} tokens in the block table")
    shape = pool_shape(layout, max(block_table) + 1, block_size, num_kv_heads, head_dim)
    s_block, s_token, s_head, _ = pool_strides(torch.empty(shape, device="meta"), layout)
    addresses = []
    for position in range(seq_len):
        block_id, offset = block_table[position // block_size], position % block_size
        start = block_id * s_block + offset * s_token + kv_head * s_head
        addresses.extend(range(start, start + head_dim))
    return addresses


def contiguous_runs(addresses: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive offsets, [(first_address, length_in_elements), ...]."""
    runs: list[tuple[int, int]] = []
    for address in addresses:
        if runs and runs[-1][0] + runs[-1][1] == address:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((address, 1))
    return runs


@dataclass(frozen=True)
class RunStats:
    """How one program's reads break into contiguous runs (bytes, not elements)."""

    layout: str
    num_runs: int
    bytes_read: int
    mean_run_bytes: float
    min_run_bytes: int
    max_run_bytes: int


def run_stats(layout: str, block_table: list[int], seq_len: int, kv_head: int, block_size: int,
              num_kv_heads: int, head_dim: int, element_bytes: int = 2) -> RunStats:
    """The contiguous runs one program reads, in bytes; neighbouring blocks merge into one run."""
    addresses = program_addresses(layout, block_table, seq_len, kv_head, block_size,
                                  num_kv_heads, head_dim)
    lengths = [length * element_bytes for _, length in contiguous_runs(addresses)]
    return RunStats(layout, len(lengths), sum(lengths), sum(lengths) / len(lengths),
                    min(lengths), max(lengths))


def plot_program_reads(block_table: list[int], seq_len: int, kv_head: int, block_size: int,
                       num_kv_heads: int, head_dim: int, ax=None):
    """The flat pool, one row per layout, the elements one program reads dark; returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.2))
    num_blocks = max(block_table) + 1
    total = num_blocks * block_size * num_kv_heads * head_dim
    image = torch.zeros(len(LAYOUTS), total)
    for row, layout in enumerate(LAYOUTS):
        addresses = program_addresses(layout, block_table, seq_len, kv_head, block_size,
                                      num_kv_heads, head_dim)
        image[row, addresses] = 1.0
    ax.imshow(image.numpy(), aspect="auto", cmap="Greys", interpolation="nearest", vmin=-0.15)
    block_elements = block_size * num_kv_heads * head_dim
    for boundary in range(block_elements, total, block_elements):
        ax.axvline(boundary - 0.5, color="tab:blue", linewidth=0.6)
    labels = []
    for layout in LAYOUTS:
        stats = run_stats(layout, block_table, seq_len, kv_head, block_size, num_kv_heads,
                          head_dim)
        labels.append(f"{layout}\n{stats.num_runs} runs")
    ax.set_yticks(range(len(LAYOUTS)), labels)
    ax.set_xlabel("element offset in the pool (blue lines: block boundaries)")
    ax.set_title(f"K elements read by the program of KV head {kv_head} "
                 f"(block table {block_table}, seq_len {seq_len})")
    return ax
