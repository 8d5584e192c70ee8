"""Running (and waiting) requests per engine step, kvlab's scheduler against vLLM's."""

from __future__ import annotations

import textwrap
from pathlib import Path

__all__ = ["plot_steps", "steps_figure"]


def plot_steps(kvlab: dict, vllm: dict, path: str | Path, title: str = "") -> Path:
    """Save `steps_figure` to `path` (no display needed: the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = steps_figure(kvlab, vllm, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def steps_figure(kvlab: dict, vllm: dict, title: str = ""):
    """A two-panel matplotlib figure: running, then waiting requests per step, one line per
    engine (a notebook shows it inline)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for ax, key in zip(axes, ("running", "waiting")):
        # vLLM solid and wide underneath, kvlab dashed on top: equal lines stay visible.
        ax.step(range(len(vllm["steps"][key])), vllm["steps"][key], where="post", lw=3,
                alpha=0.45, label=f"vLLM {vllm['version']}")
        ax.step(range(len(kvlab["steps"][key])), kvlab["steps"][key], where="post", lw=1.3,
                ls="--", color="black", label=f"kvlab {kvlab['version']}")
        ax.set_ylabel(f"{key} requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("engine step")
    if title:
        axes[0].set_title(textwrap.fill(title, 110), fontsize=8)
    fig.tight_layout()
    return fig
