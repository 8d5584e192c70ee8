"""The side-by-side table: kvlab's result beside vLLM's, one row per figure.

Rows: tokens identical (requests whose generated ids are equal); cached tokens identical per
request; KV capacity (free blocks before the first step, and their tokens); prefix-cache queries
and hits; preemptions; per-step running and waiting, and tokens computed where recorded (equal
over how many steps, the first step they differ); engine steps; wall time and tokens computed
per second (prompt and output: the prefill speed on long prompts); output tokens/s and per
CPU-second; TTFT and TPOT (p50, p99). Timing comes from each result's `token_times_s` through
`timing`, the same arithmetic for both.
"""

from __future__ import annotations

import dataclasses

from kvlab.workload import percentile
from .settings import check_result

__all__ = ["Timing", "timing", "first_difference", "Row", "compare", "format_table",
           "decisions_equal", "speed_ratio"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds from the first step; tokens_per_s = output tokens / duration."""

    output_tokens: int
    duration_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float


def timing(result: dict) -> Timing:
    """TTFT = first token's time, TPOT = (last - first) / (tokens - 1), per request; percentiles
    over requests (linear, `kvlab.workload.percentile`)."""
    per_request = [t for t in result["token_times_s"] if t]
    ttft = [t[0] for t in per_request]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in per_request if len(t) > 1]
    tokens = sum(len(t) for t in per_request)
    duration = max((t[-1] for t in per_request), default=0.0)
    return Timing(tokens, duration, tokens / duration if duration > 0 else 0.0,
                  percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50),
                  percentile(tpot, 99))


def first_difference(a: list, b: list) -> int | None:
    """Index of the first position where two series differ (a length difference counts), else
    None."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: the figure, kvlab's value, vLLM's, and whether they agree
    (None: a figure that is not expected to agree, such as speed)."""

    name: str
    kvlab: str
    vllm: str
    same: bool | None


def _series_row(name: str, a: list, b: list) -> Row:
    where = first_difference(a, b)
    if where is None:
        text = f"equal at all {len(a)} steps"
        return Row(name, text, text, True)
    equal = sum(x == y for x, y in zip(a, b))
    shown = (f"step {where}: {a[where] if where < len(a) else '-'}",
             f"step {where}: {b[where] if where < len(b) else '-'}")
    return Row(f"{name} (equal {equal}/{max(len(a), len(b))}, first differs at step {where})",
               *shown, False)


def compare(kvlab: dict, vllm: dict) -> list[Row]:
    """The rows of the table.

    Raises:
        ValueError: a malformed result, or the two ran different numbers of requests.
    """
    check_result(kvlab, "kvlab")
    check_result(vllm, "vllm")
    if len(kvlab["outputs"]) != len(vllm["outputs"]):
        raise ValueError(f"kvlab ran {len(kvlab['outputs'])} requests, vLLM "
                         f"{len(vllm['outputs'])}: not the same workload")
    n = len(kvlab["outputs"])
    same_tokens = sum(a == b for a, b in zip(kvlab["outputs"], vllm["outputs"]))
    same_cached = sum(a == b for a, b in zip(kvlab["num_cached_tokens"],
                                             vllm["num_cached_tokens"]))
    rows = [Row("tokens identical (requests)", f"{same_tokens}/{n}", f"{same_tokens}/{n}",
                same_tokens == n),
            Row("cached tokens identical (requests)", f"{same_cached}/{n}", f"{same_cached}/{n}",
                same_cached == n)]
    for label, key in (("KV capacity (blocks free at start)", "kv_capacity_blocks"),
                       ("KV capacity (tokens)", "kv_capacity_tokens"),
                       ("prefix-cache queries (tokens)", "prefix_cache_queries"),
                       ("prefix-cache hits (tokens)", "prefix_cache_hits"),
                       ("preemptions", "num_preemptions")):
        rows.append(Row(label, f"{kvlab[key]:,}", f"{vllm[key]:,}", kvlab[key] == vllm[key]))
    steps_a, steps_b = kvlab["steps"], vllm["steps"]
    rows.append(Row("engine steps", str(len(steps_a["running"])), str(len(steps_b["running"])),
                    len(steps_a["running"]) == len(steps_b["running"])))
    rows.append(_series_row("running per step", steps_a["running"], steps_b["running"]))
    rows.append(_series_row("waiting per step", steps_a["waiting"], steps_b["waiting"]))
    if "batched_tokens" in steps_a and "batched_tokens" in steps_b:  # recorded by runs since 2026-12-02 09:35
        rows.append(_series_row("tokens computed per step", steps_a["batched_tokens"],
                                steps_b["batched_tokens"]))
    ta, tb = timing(kvlab), timing(vllm)
    rows.append(Row("wall time, first step to last token (s)", f"{ta.duration_s:.2f}",
                    f"{tb.duration_s:.2f}", None))
    rows.append(Row("tokens computed per second", _computed_per_second(kvlab, ta),
                    _computed_per_second(vllm, tb), None))
    rows.append(Row("output tokens/s", f"{ta.tokens_per_s:.1f}", f"{tb.tokens_per_s:.1f}", None))
    rows.append(Row("output tokens per CPU-second", _per_cpu_second(kvlab, ta),
                    _per_cpu_second(vllm, tb), None))
    for label, key in (("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"),
                       ("TPOT p50", "tpot_p50_s"), ("TPOT p99", "tpot_p99_s")):
        rows.append(Row(f"{label} (ms)", f"{1000 * getattr(ta, key):.0f}",
                        f"{1000 * getattr(tb, key):.0f}", None))
    return rows


def _computed_per_second(result: dict, t: Timing) -> str:
    """Prompt and output tokens the engine computed (its steps' `batched_tokens`: prefill chunks,
    recomputation and decodes; not the prefix-cache hits) over the wall time: the prefill speed
    where prompts are long. '-' where the steps' tokens were not recorded."""
    computed = result["steps"].get("batched_tokens")
    return f"{sum(computed) / t.duration_s:,.0f}" if computed and t.duration_s > 0 else "-"


def speed_ratio(kvlab: dict, vllm: dict) -> float:
    """kvlab's speed over vLLM's on the same work: vLLM's wall time / kvlab's (> 1: kvlab is
    faster)."""
    return timing(vllm).duration_s / timing(kvlab).duration_s


def _per_cpu_second(result: dict, t: Timing) -> str:
    """Output tokens over the process's CPU time from the first step to the end (all its
    threads): on a shared machine the wall clock also counts other jobs' turns, this does not;
    above tokens/s means the engine used more than one core. '-' where not recorded."""
    cpu_s = result.get("cpu_s")
    return f"{t.output_tokens / cpu_s:.1f}" if cpu_s else "-"


def decisions_equal(rows: list[Row]) -> bool:
    """Every row that is expected to agree does."""
    return all(row.same is not False for row in rows)


def format_table(rows: list[Row], title: str = "") -> str:
    """Plain text: figure, kvlab, vLLM, then '=' where they agree or 'DIFFERS' where they should
    agree and do not (blank for speed)."""
    headers = ("", "kvlab", "vLLM", "")
    cells = [(r.name, r.kvlab, r.vllm, {True: "=", False: "DIFFERS", None: ""}[r.same])
             for r in rows]
    widths = [max(len(row[i]) for row in [headers, *cells]) for i in range(4)]
    lines = [title] if title else []
    for row in [headers, *cells]:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) if i < 3 else c
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)
