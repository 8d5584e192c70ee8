"""The simulator against vLLM on this CPU: a stored comparison replayed at a CPU clock.

`kvlab compare-vllm --json` stores one workload run through vLLM's CPU build and through kvlab's
engine, with the same settings (results/cpu-vllm/parity_*.json). On those runs kvlab's scheduler
made vLLM's decisions at every step, so simulation mode, which runs the same scheduler with no
tensors, replays vLLM's schedule; what it cannot know is how long each step takes. That is the
clock's job, and this module measures how well it does it:

* `predict_comparison` replays a stored run's workload (`stored_workload`, built again from its
  parameters) at a clock, checks that the simulated decisions are vLLM's (running requests after
  every decision), and computes tokens/s, TTFT and TPOT from the simulated token times with the
  comparison's own arithmetic (`kvlab.tools.vllm_compare.table.timing`), beside each engine's
  measured figures;
* `engine_steps` reads an engine's step ends off its measured token times (a token is sampled at
  the end of the step that computed it; a step that samples nothing leaves no mark), so that
  `cpu_clock.fit_cpu_clock` can fit a clock to vLLM's own run: fitted to vLLM's other runs, it
  says how much of the error is the clock's numbers rather than the cost model's form.

`python -m kvlab.tools.calibration.against_vllm [--clock-file F]` prints the tables of
docs/cpu_clock.md (sections 2 and 3) for one stored clock, from the runs in
results/cpu-vllm/cpu_clock_runs/.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from kvlab.serving.cost_model import CostModel
from kvlab.serving.engine_core import SimulatedExecutor
from kvlab.serving.strategies import paged_manager
from ..vllm_compare.settings import EngineSettings
from ..vllm_compare.table import first_difference, timing
from ..vllm_compare.workloads import Workload
from .cpu_clock import (DEFAULT_FILE, CpuClock, StepTimes, batch_requests, fit_cpu_clock,
                        pool_blocks, run_batch, scheduler_config)

__all__ = ["stored_workload", "replay", "predict_comparison", "engine_steps", "ENGINES"]

ENGINES = ("vllm", "kvlab")
RUNS = "results/cpu-vllm/cpu_clock_runs/*.json"  # compare-vllm runs made beside the clock


def stored_workload(stored: dict, vocab_size: int) -> Workload:
    """The workload of a stored comparison, built again from its parameters (chats need
    SmolLM2's tokenizer and chat template, fetched by `kvlab fetch smollm2-135m`).

    Raises:
        ValueError: the workload built is not the stored one (prompt lengths or output tokens).
    """
    from ..vllm_compare.workloads import chat_workload, mooncake_workload

    w = stored["workload"]
    if w["name"] == "chats":
        from kvlab.checkpoint import load_chat_template, load_tokenizer

        workload = chat_workload(load_tokenizer("smollm2-135m"),
                                 load_chat_template("smollm2-135m"), w["num_chats"],
                                 max(w["max_tokens"]))
    else:
        workload = mooncake_workload(vocab_size, w["num_requests"], w["shrink"],
                                     w["max_prompt_tokens"], max(w["max_tokens"]), w["start"],
                                     w["seed"])
    lengths = [len(p) for p in workload.prompts]
    if lengths != w["prompt_lengths"] or workload.max_tokens != w["max_tokens"]:
        raise ValueError(f"the {w['name']} workload built here ({sum(lengths):,} prompt tokens, "
                         f"{sum(workload.max_tokens):,} output) is not the stored one "
                         f"({sum(w['prompt_lengths']):,}, {sum(w['max_tokens']):,})")
    return workload


def replay(stored: dict, workload: Workload, cost: CostModel) -> dict:
    """The stored run's workload and settings through kvlab's scheduler in simulation mode at
    `cost`'s clock (`cpu_clock.run_batch`'s result)."""
    settings = EngineSettings(**stored["settings"])
    kv = paged_manager(pool_blocks(settings, cost.config), settings.block_size,
                       settings.max_model_len, settings.enable_prefix_caching)
    return run_batch(batch_requests(workload), kv, SimulatedExecutor(cost),
                     scheduler_config(settings))


def predict_comparison(stored: dict, workload: Workload, cost: CostModel) -> dict:
    """A stored run replayed at `cost`'s clock.

    Returns:
        {'predicted': `timing` of the simulated run, 'vllm' and 'kvlab': `timing` of each engine's
        measured one, 'steps_equal': the running count after every decision equals vLLM's (bool),
        'steps': (simulated, vLLM's) step counts}.
    """
    simulated = replay(stored, workload, cost)
    ours, theirs = simulated["steps"]["running"], stored["vllm"]["steps"]["running"]
    return {"predicted": timing(simulated),
            **{engine: timing(stored[engine]) for engine in ENGINES},
            "steps_equal": first_difference(ours, theirs) is None,
            "steps": (len(ours), len(theirs))}


def engine_steps(stored: dict, workload: Workload, cost: CostModel, engine: str) -> StepTimes:
    """The simulated steps' sizes with `engine`'s measured step ends (nan where the step sampled
    nothing).

    Raises:
        ValueError: the tokens of one simulated step were sampled at different times by the
            engine (its decisions were not the simulated ones).
    """
    simulated = replay(stored, workload, cost)
    steps = simulated["step_times"]
    ends = np.full(len(steps.ends), np.nan)
    for measured, step_of in zip(stored[engine]["token_times_s"], simulated["token_steps"]):
        for t, step in zip(measured, step_of):
            if not np.isnan(ends[step]) and abs(ends[step] - t) > 1e-6:
                raise ValueError(f"{engine} sampled two tokens of simulated step {step} at "
                                 f"{ends[step]:.6f} s and {t:.6f} s: not the same schedule")
            ends[step] = t
    return StepTimes(steps.sizes, ends)


def _configuration(stored: dict) -> str:
    """A run's configuration, the same for its repeats: workload, prefix caching, pool, budget."""
    w, st = stored["workload"], stored["settings"]
    return (f"{w['name']}, prefix caching {'on' if st['enable_prefix_caching'] else 'off'}, "
            f"{st['num_blocks']} blocks, {st['max_num_batched_tokens']:,} tokens a step")


FIGURES = (("tokens/s", "tokens_per_s", 1, 1), ("TTFT p50 ms", "ttft_p50_s", 1e3, 0),
           ("TPOT p50 ms", "tpot_p50_s", 1e3, 0))


def _table(title: str, rows: Sequence[tuple[str, str, list[dict]]]) -> None:
    """One row per configuration: (configuration, engine measured, `predict_comparison` of each
    of its repeats); measured figures as the median [lowest, highest] over the repeats."""
    print(f"\n{title}\n\n| configuration (repeats) | steps equal | "
          + " | ".join(f"{name}: measured / simulated (error)" for name, *_ in FIGURES)
          + " |\n|---|---|---|---|---|")
    for configuration, engine, repeats in rows:
        cells = []
        for _, key, scale, digits in FIGURES:
            measured = sorted(scale * getattr(r[engine], key) for r in repeats)
            simulated = scale * getattr(repeats[0]["predicted"], key)
            median = float(np.median(measured))
            spread = (f" [{measured[0]:,.{digits}f}–{measured[-1]:,.{digits}f}]"
                      if len(measured) > 1 else "")
            cells.append(f"{median:,.{digits}f}{spread} / {simulated:,.{digits}f} "
                         f"({simulated / median - 1:+.0%})")
        equal = all(r["steps_equal"] for r in repeats)
        print(f"| {configuration} ({len(repeats)}) | {equal} ({repeats[0]['steps'][0]}) | "
              + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvlab.tools.calibration.against_vllm`: every stored comparison predicted at the
    CPU clock (beside vLLM's and kvlab's measured figures), then at a clock fitted to vLLM's own
    other runs."""
    import argparse

    from kvlab.config import load_config

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--clock-file", default=DEFAULT_FILE)
    parser.add_argument("--runs", nargs="+", help=f"stored comparisons (default: {RUNS})")
    args = parser.parse_args(argv)
    config = load_config("smollm2-135m")
    clock = CpuClock.load(args.clock_file)
    cost = clock.cost_model(config)
    runs = []
    for path in map(Path, args.runs or sorted(glob.glob(RUNS))):
        stored = json.loads(path.read_text())
        runs.append((path.stem, stored, stored_workload(stored, config.vocab_size)))
    print(f"{clock.describe()} ({args.clock_file}, {clock.measured.get('date', 'undated')})")
    configurations: dict[str, list[tuple[dict, Workload]]] = {}
    for _, stored, workload in runs:
        configurations.setdefault(_configuration(stored), []).append((stored, workload))
    for engine in ENGINES:
        _table(f"CPU clock (kvlab's model mode timed) against {engine}'s measured figures",
               [(name, engine, [predict_comparison(s, w, cost) for s, w in repeats])
                for name, repeats in configurations.items()])
    rows = []
    for name, repeats in configurations.items():  # a clock from vLLM's other configurations
        others = [engine_steps(s, w, cost, "vllm") for other, more in configurations.items()
                  if other != name for s, w in more]
        # the bandwidth is this machine's, measured with the clock: decode steps all read about
        # the same bytes, so the intervals alone cannot tell it from the per-step overhead
        fitted = fit_cpu_clock(config, others, bandwidth_bytes_per_s=clock.bandwidth_bytes_per_s)
        print(f"{name}: fitted to vLLM's runs of the other configurations: {fitted.describe()}")
        rows.append((name, "vllm", [predict_comparison(s, w, fitted.cost_model(config))
                                    for s, w in repeats]))
    _table("Clock fitted to vLLM's runs of the other configurations, against vLLM's measured "
           "figures", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
