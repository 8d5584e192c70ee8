"""The GPU tour command: run every stage, print progress, write the summary, pack what comes back.

    python scripts/gpu_tour.py [--dry-run] [--out DIR] [--pack DIR] [--budget SECONDS]

On a CUDA machine the default folder is results/gpu/<card>-<date>/ (commit it: its notebooks/ hold
the course's GPU edition, every notebook executed on the card); the dry run writes to
<tmp>/kvlab-gpu-tour-dry-run/. Built for a lent machine that may be taken away at any
moment and hands back only a few files:

* the whole tour has a budget (default `stages.BUDGET_S`, 540 s), held by a watchdog
  (`stage_process.Watchdog`); each stage's own limit is cut to what is left, holds whether or not
  the stage prints, and a stage that no longer fits is recorded as skipped, never dropped;
* SUMMARY.md is written before and after every stage, and the archive repacked after every stage,
  so a tour killed midway leaves what it had;
* `--pack DIR` (the device's $OUT) gets exactly two files: SUMMARY.md and <folder>.tar.gz
  (`packing`: what the device returns); without it the archive goes beside the folder;
* the exit status is 0 only when every stage was ok, 1 otherwise (2: it could not start).

A stage that fails or times out is recorded and the next one still runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .packing import pack
from .stage_process import StageProcess, Watchdog, run_with_limit
from .stages import BUDGET_S, DRY_RUN_SCALE, Stage, plan_stages, summarize_junit

__all__ = ["missing_modules", "install_wheels", "prepare_packages", "write_summary", "run_tour",
           "main"]

MIN_STAGE_S = 10  # a stage is not started with less time than this left
# Import names the stages need. The lent H200's image has all of them (tokenizers, safetensors and
# tqdm included); another machine without network may carry wheels (scripts/gpu_tour_wheels.sh).
NEEDED_MODULES = ("torch", "triton", "numpy", "matplotlib", "pytest", "tokenizers", "safetensors",
                  "tqdm")
INSTALL_HINT = "pip install --no-deps --no-build-isolation --no-index -e ."


def missing_modules(names: tuple[str, ...] = NEEDED_MODULES) -> list[str]:
    """The modules in `names` that cannot be imported here (found without importing them)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def install_wheels(folder: Path, names: list[str]) -> None:
    """pip install the named packages from a folder of wheels, offline, without dependencies.

    Raises:
        RuntimeError: pip failed (its last line is in the message).
    """
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                           "--no-deps", "--find-links", str(folder), *names],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeError(f"pip install from {folder} failed: {reason}")


def prepare_packages(wheels: Path | None, names: tuple[str, ...] = NEEDED_MODULES) -> list[str]:
    """Install what is missing from `wheels` if given; never raises. Returns the summary's notes
    (a pip failure, what is still missing): the stages that need a missing module fail and say
    so, the others run."""
    notes, missing = [], missing_modules(names)
    if missing and wheels is not None:
        print(f"gpu tour: installing {', '.join(missing)} from {wheels}", flush=True)
        try:
            install_wheels(wheels, missing)
        except (RuntimeError, OSError) as error:
            print(f"gpu tour: warning: {error}; the tour goes on without them", flush=True)
            notes.append(f"- {error}")
        missing = missing_modules(names)
    if missing:
        print(f"gpu tour: warning: cannot import {', '.join(missing)}", flush=True)
        notes.append(f"- missing here: {', '.join(missing)} (stages that need them failed)")
    return notes


def _stage_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    if dry_run:  # CPU even on a GPU machine; stage 5's kernels in Triton's interpreter
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("TRITON_INTERPRET", None)  # the real compiler
    return env


class _Current:
    """The stage process running now, for the watchdog and for an interrupt to kill."""

    process: StageProcess | None = None

    def kill(self, reason: str) -> None:
        if self.process is not None:
            self.process.kill(reason)


def _run_stage(stage: Stage, env: dict[str, str], cwd: Path, current: _Current) -> None:
    """Run one stage's command under its limit, its lines prefixed and into <out>/<name>.log."""
    stage.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def started(process: StageProcess) -> None:
        current.process = process

    try:
        code, killed = run_with_limit(stage.command, cwd, env, stage.out / f"{stage.name}.log",
                                      stage.timeout_s, f"[{stage.name}] ", started)
    finally:
        current.process = None
        stage.seconds = time.perf_counter() - start
    # pytest: 5 = nothing selected (no CUDA tests), not a failure.
    if code is None:
        stage.status = killed
    elif code == 0 or (stage.kind == "tests" and code == 5):
        stage.status = "ok"
    else:
        stage.status = f"failed (exit {code})"


def _benchmark_reuse(stages: list[Stage]) -> list[str]:
    """--reuse NAME=JSON for each benchmark that finished, so notebooks do not rerun it."""
    reuse = []
    for stage in stages:
        result = stage.out / f"{stage.name}.json"
        if stage.kind == "benchmark" and stage.status == "ok" and result.is_file():
            reuse += ["--reuse", f"{stage.name}={result}"]
    return reuse


def _headline(stage: Stage) -> str | None:
    """The stage's headline figure from the JSON it wrote, or None when it has none."""
    result = stage.out / f"{stage.name}.json"
    if stage.kind not in ("benchmark", "story") or not result.is_file():
        return None
    record = json.loads(result.read_text())
    if stage.kind == "story":  # every story is an oom_story run
        from ..oom_story.report import headline

        return headline(record)
    goal = record.get("goal") or {}
    if not goal:
        return None
    return (f"- {stage.name}: {goal['pct_of_copy']:.1f} % of copy bandwidth, "
            f"{goal['x_sdpa']:.2f}x SDPA's time at batch x context x block {goal['point']}")


def _headlines(out: Path, stages: list[Stage]) -> list[str]:
    """One line per stage that has a headline figure, read from the files the stages wrote (a
    file that a killed stage left half-written is named, not read)."""
    lines = []
    env_file = out / "environment" / "environment.json"
    try:
        if env_file.is_file():
            env = json.loads(env_file.read_text())
            memory = f", {env['total_memory_bytes']:,} B" if "total_memory_bytes" in env else ""
            lines.append(f"- environment: {env['card']}{memory}; copy bandwidth "
                         f"{env['copy_gb_s']:,.1f} GB/s (measured in this run)")
    except (ValueError, KeyError, TypeError) as error:
        lines.append(f"- environment: environment.json unreadable ({type(error).__name__})")
    for stage in stages:
        try:
            line = _headline(stage)
        except (ValueError, KeyError, TypeError, IndexError) as error:
            line = f"- {stage.name}: {stage.name}.json unreadable ({type(error).__name__}: {error})"
        if line is not None:
            lines.append(line)
    return lines


def write_summary(out: Path, stages: list[Stage], dry_run: bool, seconds: float,
                  notes: tuple[str, ...] = (), budget_s: float | None = None) -> str:
    """SUMMARY.md: mode, date, one row per stage (status, time, its summary file), headlines."""
    tests = [stage for stage in stages if stage.kind == "tests" and stage.status != "not run"]
    if tests and tests[0].out.is_dir():
        (tests[0].out / "tests.md").write_text(summarize_junit(tests[0].out / "junit.xml"))
    files = {"environment": "environment/environment.md", "tests": "tests/tests.md",
             "benchmark": "benchmarks/{name}.md", "story": "{name}/{name}.md",
             "notebook": "notebooks/{name}.md"}
    mode = ("dry run: CPU, toy sizes, Triton interpreter — not measured on a GPU" if dry_run
            else "GPU tour")
    budget = f" of a {budget_s:.0f} s budget" if budget_s else ""
    ok = sum(stage.status == "ok" for stage in stages)
    lines = ["# kvlab GPU tour", "",
             f"{mode}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
             f"{seconds:.0f} s{budget}; {ok} of {len(stages)} stages ok.", "",
             *_headlines(out, stages), *notes, "",
             "| stage | status | seconds | limit | summary |", "|---|---|---|---|---|"]
    for stage in stages:
        summary = files[stage.kind].format(name=stage.name)
        link = f"[{summary}]({summary})" if (out / summary).is_file() else "—"
        lines.append(f"| {stage.name} | {stage.status} | {stage.seconds:.1f} | "
                     f"{stage.timeout_s} | {link} |")
    text = "\n".join(lines) + "\n"
    (out / "SUMMARY.md").write_text(text)
    return text


RUNNING = "running (a tour killed now leaves it so)"


def run_tour(repo: Path, out: Path, stages: list[Stage], dry_run: bool = False,
             budget_s: float = BUDGET_S, pack_dir: Path | None = None,
             notes: tuple[str, ...] = ()) -> tuple[Path, int]:
    """Run the stages within budget_s seconds (the watchdog's), writing the summary before and
    after each and packing after each. Returns (the archive, the exit status: 0 when every stage
    was ok, else 1)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    env, current = _stage_env(dry_run), _Current()
    notes = list(notes)

    def checkpoint(archive: bool) -> Path:
        text = write_summary(out, stages, dry_run, time.perf_counter() - start, tuple(notes),
                             budget_s)
        dest = pack_dir if pack_dir is not None else out.parent
        if not archive:  # the summary alone: which stage is running
            if pack_dir is not None:
                pack_dir.mkdir(parents=True, exist_ok=True)
                (pack_dir / "SUMMARY.md").write_text(text)
            return dest / f"{out.name}.tar.gz"
        path, left_out = pack(out, dest, "SUMMARY.md" if pack_dir is not None else None)
        new = [f"- left out of the archive (over its size limit): {file.relative_to(out)}"
               for file in left_out]
        notes.extend(note for note in new if note not in notes)
        if new and pack_dir is not None:  # the summary that travels names what did not
            (pack_dir / "SUMMARY.md").write_text(write_summary(
                out, stages, dry_run, time.perf_counter() - start, tuple(notes), budget_s))
        return path

    watchdog = Watchdog(budget_s, lambda: current.kill(
        f"killed by the watchdog at the tour's {budget_s:.0f} s budget")).start()
    print(f"kvlab GPU tour{' (dry run)' if dry_run else ''}: {len(stages)} stages, "
          f"{budget_s:.0f} s budget -> {out}", flush=True)
    try:
        checkpoint(archive=True)
        for number, stage in enumerate(stages, 1):
            left = watchdog.left_s()
            if left < MIN_STAGE_S:
                stage.status = f"skipped: {max(0, left):.0f} s of the {budget_s:.0f} s budget left"
                print(f"== {number}/{len(stages)} {stage.name}: {stage.status}", flush=True)
                continue
            stage.timeout_s = int(min(stage.timeout_s, left))
            if stage.kind == "notebook":  # the notebook stops itself a little before its limit
                stage.command += ["--timeout", str(max(1, stage.timeout_s - 5)),
                                  *_benchmark_reuse(stages)]
            print(f"== {number}/{len(stages)} {stage.name} (limit {stage.timeout_s} s)",
                  flush=True)
            stage.status = RUNNING
            checkpoint(archive=False)
            _run_stage(stage, env, repo, current)
            print(f"== {stage.name}: {stage.status} in {stage.seconds:.1f} s", flush=True)
            checkpoint(archive=True)
    except BaseException:  # an interrupt (Ctrl-C, SIGTERM): the stage goes down with the tour
        current.kill("interrupted")
        for stage in stages:
            if stage.status == RUNNING:
                stage.status = "interrupted"
        checkpoint(archive=True)
        raise
    finally:
        watchdog.stop()
    archive = checkpoint(archive=True)
    print((out / "SUMMARY.md").read_text(), flush=True)
    print(f"archive: {archive} ({archive.stat().st_size:,} B)", flush=True)
    return archive, 0 if all(stage.status == "ok" for stage in stages) else 1


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None, repo: Path | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy sizes, Triton interpreter: the same harness, no GPU needed")
    parser.add_argument("--out", type=Path, default=None, help="folder for results")
    parser.add_argument("--pack", type=Path, default=None, metavar="DIR",
                        help="after every stage, write SUMMARY.md and <out>.tar.gz here (and "
                             "nothing else): the device's $OUT")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole tour (default {BUDGET_S}; the dry run "
                             f"{DRY_RUN_SCALE}x)")
    parser.add_argument("--notebooks", nargs="*", default=None, metavar="PREFIX",
                        help="only these notebooks (name prefixes, e.g. 01 04b) instead of all")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=("environment", "tests", "benchmark", "story", "notebook"))
    parser.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                        help="install missing packages from this folder of wheels first "
                             "(offline; default: the repository's .whl/ when it exists)")
    parser.add_argument("--repo", type=Path, default=repo or Path.cwd(),
                        help="repository root (holds notebooks/, tests/, tools/)")
    args = parser.parse_args(argv)
    if not (args.repo / "notebooks").is_dir():
        print(f"gpu tour: error: {args.repo} has no notebooks/ folder; pass --repo",
              file=sys.stderr)
        return 2
    if importlib.util.find_spec("kvlab.kernels") is None:  # pyproject maps it from kernels/
        print(f"gpu tour: error: kvlab.kernels cannot be imported: kvlab is not installed (it "
              f"maps kernels/ to kvlab.kernels); install it first: {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    default_out = Path(tempfile.gettempdir()) / "kvlab-gpu-tour-dry-run"
    if not args.dry_run:
        import torch

        from ..machine import card_slug

        if not torch.cuda.is_available():
            print("gpu tour: error: no CUDA GPU here; use --dry-run to run the harness on the CPU",
                  file=sys.stderr)
            return 2
        now = datetime.datetime.now(datetime.timezone.utc)
        default_out = args.repo / "results" / "gpu" / f"{card_slug('cuda')}-{now:%Y-%m-%d}"
    wheels = args.wheels or (args.repo / ".whl" if (args.repo / ".whl").is_dir() else None)
    notes = prepare_packages(wheels, NEEDED_MODULES)
    budget = args.budget or BUDGET_S * (DRY_RUN_SCALE if args.dry_run else 1)
    out = (args.out or default_out).resolve()
    stages = plan_stages(args.repo.resolve(), out, args.dry_run, args.notebooks, tuple(args.skip))
    signal.signal(signal.SIGTERM, _terminate)
    try:
        _, status = run_tour(args.repo.resolve(), out, stages, args.dry_run, budget,
                             args.pack.resolve() if args.pack else None, tuple(notes))
    except KeyboardInterrupt as error:
        print(f"gpu tour: interrupted ({error}); the summary says what ran", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    raise SystemExit(main())
