"""Tables and the roofline plot of the stage-5 benchmark, and stage 4's waste per block size.

Kept apart from the timing code so a learner can read (and the tests can run) them without a GPU.
"""

from __future__ import annotations

__all__ = ["stage4_waste", "format_markdown", "plot_roofline"]


def stage4_waste(block_sizes, num_requests: int = 2000, max_model_len: int = 4096) -> dict:
    """Stage 4's paged waste (1 - tokens held / slots reserved, over every decode step) per
    block size, on the requests stage 4's block-size sweep replays (notebook 04, section 5): the
    first `num_requests` of the Azure conversation trace, at `max_model_len`."""
    from kvlab.report import PagedStrategy, replay
    from kvlab.traces import azure_trace

    requests = azure_trace("conv", limit=num_requests)
    strategies = [PagedStrategy(block_size, bytes_per_token=1) for block_size in block_sizes]
    report = replay(requests, strategies, max_model_len=max_model_len, kv_budget_bytes=1)
    return {block_size: row.waste for block_size, row in zip(block_sizes, report.rows)}


def _x(value, digits=3) -> str:
    return "—" if value is None else f"{value:.{digits}g}×"


def _g(value: float) -> str:
    """Three significant digits, without exponents for the sizes a GPU run produces."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _datasheet(gb_s) -> str:
    return "not listed for this card" if gb_s is None else f"{_g(gb_s)} GB/s"


def _clocks(before, results: dict) -> str:
    """' Clocks (now / max) before the grid: SM .. MHz, memory .. MHz, P0; after: ...' or ''
    without nvidia-smi."""
    def one(clocks):
        return (f"SM {clocks['sm_mhz']} / {clocks['max_sm_mhz']} MHz, memory "
                f"{clocks['memory_mhz']} / {clocks['max_memory_mhz']} MHz, {clocks['pstate']}")

    if not before:
        return ""
    after = results.get("clocks_after")
    return (f" Clocks (now / max) before the grid: {one(before)}"
            + (f"; after it: {one(after)}." if after else "."))


def format_markdown(results: dict) -> str:
    """The benchmark as Markdown: environment, the grid, the layout study, the goal."""
    env, shape = results["environment"], results["shape"]
    lines = [
        f"# Stage 5: paged decode attention on {env['card']}",
        "",
        f"{env['date']} · torch {env['torch']} · Triton {env['triton']} · Python {env['python']}"
        f" · {env['dtype']} · {env['mode']}",
        "",
        f"Shape: {shape['num_heads']} query heads, {shape['num_kv_heads']} KV heads, head_dim "
        f"{shape['head_dim']}. Measured in this run: read (a sum) "
        f"**{_g(results['read_gb_s'])} GB/s**, device-to-device copy "
        f"**{_g(results['copy_gb_s'])} GB/s** (read + written); datasheet "
        f"{_datasheet(results.get('datasheet_gb_s'))}; matmul "
        f"{_g(results['matmul_tflops'])} TFLOP/s.{_clocks(env.get('clocks'), results)}",
        "",
        "Ratios are t_other / t_kernel (> 1: the kernel is faster); paging overhead is t(shuffled "
        "table) / t(identity table). Timing: `do_bench` (launched from Python), `cuda_graph` "
        "(replayed from a CUDA graph: the small points) or `cpu_once` (toy mode). SDPA's backend "
        "is the one it dispatched to; MATH would be the unfused fall-back.",
        "",
        "| batch | context | block | timing | kernel ms | GB/s | % of read | % of copy | splits | "
        "vs SDPA contiguous (backend) | vs torch paged ref | vs FlexAttention | paging overhead |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["points"]:
        flex = _x(r.get("x_flex")) if "flex_error" not in r else "error"
        sdpa = f"{_x(r.get('x_sdpa'))} ({r['sdpa_backend']})" if "sdpa_backend" in r else "—"
        lines.append(f"| {r['batch']} | {r['context']:,} | {r['block_size']} | {r['timing']} | "
                     f"{_g(r['ms'])} | {_g(r['gb_s'])} | {_g(r['pct_of_read'])}% | "
                     f"{_g(r['pct_of_copy'])}% | {r['launch']['num_splits']} | {sdpa} | "
                     f"{_x(r.get('x_torch_ref'))} | {flex} | {_x(r['paging_overhead'], 3)} |")
    flexed = [r for r in results["points"] if "flex_visited_per_owned" in r]
    if flexed:
        lines += ["", "FlexAttention's block mask has mask blocks of the pool's block size, so it "
                  "loads only the tokens it owns; its default 128-slot blocks would load more:", ""]
        lines += [f"- batch {r['batch']} × {r['context']:,}, block {r['block_size']}: "
                  f"{r['flex_visited_per_owned']:.3g} tokens loaded per token owned "
                  f"(128-slot mask: {_x(r.get('flex_default_visited_per_owned'), 3)})"
                  for r in flexed]
    errors = [r for r in results["points"] if "flex_error" in r]
    if errors:
        lines += ["", f"FlexAttention failed: {errors[0]['flex_error']}"]
    lines += ["", "## The layout problem: layout × block size", "",
              "Stage 4's waste is 1 − tokens held / slots reserved on the first 2,000 requests of "
              "the Azure conversation trace (notebook 04, section 5).", "",
              "| layout | block_size | kernel ms | GB/s | % of read | % of copy | stage-4 waste |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["layouts"]:
        lines.append(f"| {r['layout']} | {r['block_size']} | {_g(r['ms'])} | {_g(r['gb_s'])} | "
                     f"{_g(r['pct_of_read'])}% | {_g(r['pct_of_copy'])}% | "
                     f"{r['stage4_waste']:.2%} |")
    goal = results.get("goal")
    if goal:
        batch, context, block_size = goal["point"]
        launch = goal["launch"]
        lines += ["", f"**Goal at batch {batch} × {context:,} context (block {block_size}):** "
                  f"{_g(goal['pct_of_copy'])}% of copy bandwidth (goal ≥ 85%: "
                  f"{'met' if goal['bandwidth_goal_met'] else 'not met'}), "
                  f"{_g(goal['pct_of_read'])}% of read bandwidth; "
                  f"{goal['x_sdpa']:.3g}× SDPA's time on the contiguous layout, SDPA's backend "
                  f"{goal['sdpa_backend']} (goal ≥ 1: "
                  f"{'met' if goal['sdpa_goal_met'] else 'not met'}).", "",
                  f"The kernel that ran there: grid {launch['grid']}, tile {launch['tile']}, "
                  f"{launch['registers']} registers a thread ({launch['spilled']} spilled), "
                  f"{launch['shared_bytes']} B of shared memory a program, "
                  f"{launch['num_warps']} warps, {launch['num_stages']} stages "
                  "(None: the interpreter compiles nothing)."]
    return "\n".join(lines) + "\n"


def plot_roofline(results: dict):
    """Roofline: achieved TFLOP/s against FLOPs per byte, under the measured read and copy
    bandwidths, the datasheet's (dashed) and the measured matmul roof. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    peak, bandwidth = results["matmul_tflops"], results["copy_gb_s"]
    intensities = [r["flops"] / r["bytes"] for r in results["points"]]
    low, high = min(intensities) / 4, max(peak * 1e3 / bandwidth, max(intensities)) * 4
    xs = [low * (high / low) ** (i / 100) for i in range(101)]
    ax.plot(xs, [min(bandwidth * x / 1e3, peak) for x in xs], color="black",
            label=f"roof: copy {_g(bandwidth)} GB/s, matmul {_g(peak)} TFLOP/s")
    ax.plot(xs, [min(results["read_gb_s"] * x / 1e3, peak) for x in xs], color="tab:gray",
            label=f"roof: read {_g(results['read_gb_s'])} GB/s")
    if results.get("datasheet_gb_s"):
        ax.plot(xs, [min(results["datasheet_gb_s"] * x / 1e3, peak) for x in xs],
                color="tab:gray", linestyle="--",
                label=f"datasheet {_g(results['datasheet_gb_s'])} GB/s")
    for block_size in sorted({r["block_size"] for r in results["points"]}):
        rows = [r for r in results["points"] if r["block_size"] == block_size]
        ax.scatter([r["flops"] / r["bytes"] for r in rows],
                   [r["flops"] / (r["ms"] * 1e9) for r in rows], label=f"kernel, block {block_size}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Paged decode attention on {results['environment']['card']}")
    ax.legend(fontsize=8)
    return fig
