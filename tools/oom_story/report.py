"""The story's record, written out: a few lines per run, the Markdown summary, the GPU tour's
headline.

Every figure comes from the record `.story.run_story` returns (measured in that run; a refusal's
sentence is `OutOfMemoryReport.message`, stored in the record); nothing here computes one.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.sizing import format_bytes

__all__ = ["describe_run", "markdown", "write_record", "headline"]


def describe_run(run: dict) -> str:
    """A few lines for one strategy's run (the Markdown summary uses them too)."""
    lines = [f"{run['strategy']}: {run['status']} in {run['wall_s']:.1f} s, {run['num_steps']} "
             f"steps; {run['finished']} of {run['requests']} requests finished; peak "
             f"{run['peak_running']} running"]
    if "preemptions" in run:
        lines[0] += f", {run['preemptions']} preemptions, {run['rejected']} rejected"
    if "max_memory_allocated_bytes" in run:
        lines.append(f"torch.cuda.max_memory_allocated during the run: "
                     f"{run['max_memory_allocated_bytes']:,} B "
                     f"({format_bytes(run['max_memory_allocated_bytes'])})")
    if "allocator_peaks" in run:
        peaks = run["allocator_peaks"]
        lines.append(f"allocator peaks: reserved {format_bytes(peaks['reserved_bytes_peak'])}, "
                     f"in split blocks {format_bytes(peaks['inactive_split_bytes_peak'])}; "
                     f"{peaks['num_alloc_retries']} retries after freeing cached blocks")
    if "out_of_memory_errors" in run:
        lines.append(f"torch.OutOfMemoryError caught {run['out_of_memory_errors']} times; "
                     f"concurrency cap learned: {run['concurrency_cap']}")
        if run["reports"]:
            lines.append(f"first: {run['reports'][0]['message']}")
    if "num_blocks" in run:
        lines.append(f"pool {run['num_blocks']:,} blocks = {format_bytes(run['pool_bytes'])} "
                     f"({run['pool_rule']}); blocks in use at the end: "
                     f"{run['blocks_in_use_at_end']}")
    return "\n".join(lines)


def markdown(record: dict) -> str:
    """The stage's summary: setup, then each run (what the GPU tour archives)."""
    lines = ["# Stage 7 on a GPU: the naive server's out-of-memory error, and paged + prefix", "",
             f"{record['model']} ({record['dtype']}) on {record['device']}, caching allocator "
             f"settings (PYTORCH_CUDA_ALLOC_CONF): {record.get('allocator_conf', 'default')}; "
             f"weights "
             f"{record['weights_bytes']:,} B; KV {record['kv_bytes_per_token']:,} B per token; "
             f"activation peak (profiled) {record['workspace_bytes']:,} B.", "",
             f"Memory limit {record['limit_bytes']:,} B ({format_bytes(record['limit_bytes'])}): "
             f"weights + activation peak + {format_bytes(record['kv_room_bytes'])} for KV, "
             f"{record['limit_note']} (lowered on purpose, so the burst runs it out in "
             f"seconds).", "",
             f"Workload: {record['workload']}.", ""]
    if record["device"] == "cpu":
        lines += ["Dry run on the CPU: not measured on a GPU.", ""]
    lines += ["| strategy | status | finished | peak running | OutOfMemoryError caught | "
              "preemptions | max_memory_allocated |", "|---|---|---|---|---|---|---|"]
    for run in record["runs"]:
        peak = run.get("max_memory_allocated_bytes")
        lines.append(f"| {run['strategy']} | {run['status']} | {run['finished']} of "
                     f"{run['requests']} | {run['peak_running']} | "
                     f"{run.get('out_of_memory_errors', 0)} | {run.get('preemptions', '—')} | "
                     f"{format_bytes(peak) if peak is not None else 'CPU: none'} |")
    lines.append("")
    for run in record["runs"]:
        lines += ["## " + run["strategy"], "", *[f"- {line}" for line in
                                                 describe_run(run).splitlines()], ""]
    return "\n".join(lines)


def write_record(record: dict, out: Path | None) -> None:
    """<out>/<name>.json (everything) and <name>.md (`markdown`), name = record['name'];
    nothing when out is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    name = record.get("name", "oom_story")
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str))
    (out / f"{name}.md").write_text(markdown(record))


def headline(record: dict) -> str:
    """One line for the GPU tour's SUMMARY.md: the naive run's first error, and paged + prefix."""
    runs = {run["strategy"]: run for run in record["runs"]}
    naive, paged = runs.get("naive"), runs.get("paged+prefix")
    parts = []
    if naive is not None:
        reports = naive.get("reports") or []
        if reports:
            first = reports[0]
            parts.append(f"naive: torch.OutOfMemoryError at {first['num_running']} running "
                         f"({first['what']}: {format_bytes(first['requested_bytes'])} asked, "
                         f"{format_bytes(first['figures']['most_servable_bytes'])} servable, "
                         f"{format_bytes(first['figures']['inactive_split_bytes'])} in split "
                         f"blocks), {naive['out_of_memory_errors']} caught, "
                         f"{naive['finished']} of {naive['requests']} finished")
        else:
            parts.append(f"naive: no out-of-memory error, peak {naive['peak_running']} running")
    if paged is not None:
        parts.append(f"paged+prefix: peak {paged['peak_running']} running, "
                     f"{paged['finished']} of {paged['requests']} finished ({paged['status']})")
    where = "" if record["device"] != "cpu" else " (dry run on the CPU)"
    if record.get("allocator_conf", "default") != "default":
        where += f" (PYTORCH_CUDA_ALLOC_CONF={record['allocator_conf']})"
    return f"- {record.get('name', 'oom_story')}{where}: " + "; ".join(parts)
