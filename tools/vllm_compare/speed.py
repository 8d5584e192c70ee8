"""Speed over repeated comparisons: the median [lowest, highest] of each engine's figures.

On a shared machine one run's tokens/s moves by tens of percent, and both engines of a run share
its load, so the ratio within a run is steadier than either figure. This summary groups stored
`kvlab compare-vllm --json` results by their configuration (workload, prefix caching, step budget,
pool, as each result's settings record them) and gives, per configuration: tokens/s of each
engine, the ratio kvlab / vLLM, the same ratio per CPU-second of each engine's process (where the
runs recorded it: it leaves out the time other jobs took the cores), TPOT p50 of each, and
transformers' `generate` where the run had `--transformers`.

    python -m kvlab.tools.vllm_compare.speed results/cpu-vllm/speed-20261202
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .table import timing

__all__ = ["configuration", "speed_rows", "main"]


def _spread(values: list[float], digits: int) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")


def configuration(stored: dict) -> str:
    """A stored run's settings in words: 'chats, prefix caching on, 40 blocks, 2,048 tokens a
    step'."""
    settings = stored["settings"]
    pool = (f"{settings['num_blocks']} blocks" if settings.get("num_blocks") is not None
            else f"{settings['kv_cache_memory_bytes']:,} bytes")
    caching = "on" if settings["enable_prefix_caching"] else "off"
    return (f"{stored['workload']['name']}, prefix caching {caching}, {pool}, "
            f"{settings['max_num_batched_tokens']:,} tokens a step")


def speed_rows(folder: str | Path) -> list[tuple[str, ...]]:
    """(configuration, runs, kvlab tok/s, vLLM tok/s, ratio, ratio per CPU-second, TPOT p50 ms
    kvlab / vLLM, transformers tok/s) per configuration, each as median [lowest-highest]."""
    groups: dict[str, list[dict]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        stored = json.loads(path.read_text())
        if stored.get("vllm"):
            groups.setdefault(configuration(stored), []).append(stored)
    rows = []
    for name, runs in groups.items():
        ours = [timing(run["kvlab"]) for run in runs]
        theirs = [timing(run["vllm"]) for run in runs]
        baseline = [run["transformers"]["tokens_per_s"] for run in runs
                    if run.get("transformers") and "tokens_per_s" in run["transformers"]]
        per_cpu = [run["vllm"]["cpu_s"] / run["kvlab"]["cpu_s"]  # the same tokens on both sides
                   for run in runs if run["kvlab"].get("cpu_s") and run["vllm"].get("cpu_s")]
        rows.append((name, str(len(runs)), _spread([t.tokens_per_s for t in ours], 1),
                     _spread([t.tokens_per_s for t in theirs], 1),
                     _spread([a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs)], 2),
                     _spread(per_cpu, 2) if per_cpu else "-",
                     f"{statistics.median(1000 * t.tpot_p50_s for t in ours):.0f} / "
                     f"{statistics.median(1000 * t.tpot_p50_s for t in theirs):.0f}",
                     _spread(baseline, 1) if baseline else "-"))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m kvlab.tools.vllm_compare.speed FOLDER_OF_COMPARISON_JSONS",
              file=sys.stderr)
        return 2
    header = ("configuration", "runs", "kvlab tok/s", "vLLM tok/s", "kvlab / vLLM",
              "kvlab / vLLM per CPU-second", "TPOT p50 ms kvlab / vLLM", "transformers tok/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in speed_rows(args[0]):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
