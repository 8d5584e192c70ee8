"""Pictures the notebooks draw from the library's own state (matplotlib).

`draw_block_tables(cache)` is figure 6 of Kwon et al. (SOSP 2023) drawn from a live
`PagedKVCache`: each block table on top (`logical → physical`, an arrow to each block), the pool
below, slots coloured by owner and labelled with their token's position; a shared block (after
`fork`, before copy-on-write) hatched, with its ref count.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported when a picture is drawn, not with kvlab
    from matplotlib.figure import Figure

    from .paged import PagedKVCache

__all__ = ["draw_block_tables"]


def draw_block_tables(cache: "PagedKVCache", title: str = "") -> "Figure":
    """The pyplot figure (assign it, or the notebook shows it twice); `cache` needs
    `.manager.tables`, `.block_size`, `.num_blocks`. ValueError: the cache holds no sequence."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    manager, size = cache.manager, cache.block_size
    seqs = list(manager.tables)
    if not seqs:
        raise ValueError("the cache holds no sequence: allocate one before drawing its block table")
    colours = {seq: plt.cm.tab10(i % 10) for i, seq in enumerate(seqs)}
    owners = collections.defaultdict(list)  # block id -> [(seq, logical index)]
    for seq in seqs:
        for index, block_id in enumerate(manager.tables[seq].block_ids):
            owners[block_id].append((seq, index))

    step = size + 1  # physical blocks side by side, one slot apart
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.55 * len(seqs)))
    for block_id in range(cache.num_blocks):
        x0 = block_id * step
        ax.add_patch(Rectangle((x0, 0), size, 1, fill=False, lw=1.5))
        holders = owners.get(block_id, [])  # .get: looking up must not add an empty entry
        shared = len(holders) > 1
        label = f"block {block_id}" + (f"\nref count {len(holders)}" if shared else "")
        ax.text(x0 + size / 2, -0.15, label, ha="center", va="top", fontsize=8)
        if not holders:  # a free block: an empty box
            continue
        # Shared blocks hold the same tokens for every owner: draw them with the first one's colour.
        seq, index = holders[0]
        for offset in range(manager.tables[seq].tokens_in_block(index)):
            ax.add_patch(Rectangle((x0 + offset, 0), 1, 1, facecolor=colours[seq], alpha=0.75,
                                   hatch="//" if shared else None, edgecolor="white"))
            ax.text(x0 + offset + 0.5, 0.5, index * size + offset, ha="center", va="center",
                    fontsize=7)

    for row, seq in enumerate(reversed(seqs)):  # the first sequence on top
        y = 2.2 + 0.9 * row
        ax.text(-0.6, y + 0.3, f"seq {seq}", ha="right", va="center", fontsize=9)
        for index, block_id in enumerate(manager.tables[seq].block_ids):
            x = index * 2.6
            ax.add_patch(Rectangle((x, y), 2.2, 0.6, facecolor=colours[seq], zorder=2))
            ax.text(x + 1.1, y + 0.3, f"{index}→{block_id}", ha="center", va="center", fontsize=8,
                    zorder=3)
            ax.annotate("", xy=(block_id * step + size / 2, 1.02), xytext=(x + 1.1, y),
                        arrowprops=dict(arrowstyle="->", color=colours[seq], lw=0.8), zorder=1)
    ax.set_xlim(-3.5, cache.num_blocks * step)
    ax.set_ylim(-0.9, 2.4 + 0.9 * len(seqs))
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return fig
