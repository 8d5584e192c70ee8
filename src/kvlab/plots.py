"""Pictures the notebooks draw from the library's own state (matplotlib).

`draw_block_tables(cache)` is figure 6 of Kwon et al. (SOSP 2023) drawn from a live
`PagedKVCache`: each block table on top (`logical → physical`, an arrow to each block), the pool
below, slots coloured by owner and labelled with their token's position; a shared block (after
`fork`, before copy-on-write) hatched, with its ref count.

`draw_timeline(steps)` is a Gantt chart of a scheduler at work, one row per request and one column
per engine step, each cell coloured by what the request did in that step (`step_phases` reads it
from a `SchedulerOutput`): waiting, a prefill chunk, a decode step, preempted (its blocks freed, to
be recomputed), finished. It is how the Orca paper (Yu et al., OSDI 2022, figure 4) and the
Sarathi-Serve paper (Agrawal et al., OSDI 2024, figure 1) draw iteration-level scheduling.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported when a picture is drawn, not with kvlab
    from matplotlib.figure import Figure

    from .paged import PagedKVCache

__all__ = ["PHASES", "draw_block_tables", "draw_timeline", "step_phases"]

# What a request did in one engine step, and its colour in `draw_timeline`.
PHASES = {"waiting": "#d9d9d9", "prefill": "#4c78a8", "decode": "#54a24b",
          "preempted": "#e45756", "finished": "#000000"}


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


def step_phases(output, waiting=()) -> dict:
    """{request_id: phase} of one step, read *before* `Scheduler.update` moves the requests on:
    each scheduled request's prefill chunk or decode step, each preempted one and each still
    waiting. `output`: a `SchedulerOutput`; waiting: the scheduler's waiting requests. After the
    update, mark the requests it returned as finished: `phases[r.request_id] = "finished"`."""
    phases = {request.request_id: "waiting" for request in waiting}
    for request in output.preempted:
        phases[request.request_id] = "preempted"
    for request, _num_new_tokens in output.scheduled:
        prefilling = request.num_computed_tokens < request.prompt_len
        phases[request.request_id] = "prefill" if prefilling else "decode"
    return phases


def draw_timeline(steps, title: str = "", request_ids=None) -> "Figure":
    """The pyplot figure of `steps`, a list of `{request_id: phase}` (one per engine step, phases
    from `PHASES`); rows in `request_ids` order (default: first seen first). A request absent
    from a step (not arrived, or gone) is left blank. ValueError: an unknown phase."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    order = list(request_ids) if request_ids is not None else list(dict.fromkeys(
        request_id for step in steps for request_id in step))
    row = {request_id: index for index, request_id in enumerate(order)}
    fig, ax = plt.subplots(figsize=(min(12, 2 + 0.35 * len(steps)), 0.9 + 0.35 * len(order)))
    for number, step in enumerate(steps):
        for request_id, phase in step.items():
            if phase not in PHASES:
                raise ValueError(f"step {number}: request {request_id} has phase {phase!r}; "
                                 f"expected one of {', '.join(PHASES)}")
            if request_id in row:
                ax.barh(row[request_id], 1, left=number, color=PHASES[phase],
                        edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(order)), [f"request {request_id}" for request_id in order])
    ax.invert_yaxis()
    ax.set_xlim(0, max(len(steps), 1))
    ax.set_xlabel("engine step")
    ax.legend(handles=[Patch(color=colour, label=phase) for phase, colour in PHASES.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    return fig
