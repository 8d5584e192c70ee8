"""The GPU tour command: run every stage, print progress, write summaries, pack one archive.

    python scripts/gpu_tour.py [--dry-run] [--out DIR] [--budget SECONDS] [--notebooks 02 04]

On a CUDA machine the default folder is results/<card>/gpu-tour-<date>/ (commit it with the
archive); the dry run writes to <tmp>/kvlab-gpu-tour-dry-run/. The tour is budgeted (default 330 s,
inside the 6 minutes the course promises on an H100/H200): each stage's limit is cut to what is
left, and a stage that no longer fits is recorded as skipped, never silently dropped. A stage that
fails or times out is recorded and the next one still runs; the archive holds whatever was made.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .stages import Stage, plan_stages, summarize_junit

__all__ = ["run_tour", "main"]

MIN_STAGE_S = 10  # a stage is not started with less time than this left
# Import name -> what provides it. kvlab's runtime needs beyond torch (tokenizers, safetensors,
# tqdm) are what the reference GPU machine lacks: scripts/gpu_tour_wheels.sh fetches their wheels.
NEEDED_MODULES = ("torch", "triton", "numpy", "matplotlib", "pytest", "tokenizers", "safetensors",
                  "tqdm")


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


def _stage_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    if dry_run:  # CPU even on a GPU machine; stage 5's kernels in Triton's interpreter
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("TRITON_INTERPRET", None)  # the real compiler
    return env


def _run_stage(stage: Stage, env: dict[str, str], cwd: Path) -> None:
    """Run one stage's command, streaming its lines with a prefix and into <out>/<name>.log."""
    stage.out.mkdir(parents=True, exist_ok=True)
    log_path = stage.out / f"{stage.name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(stage.command) + "\n")
        process = subprocess.Popen(stage.command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace")
        try:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                print(f"[{stage.name}] {line.rstrip()}"[:200], flush=True)
                if time.perf_counter() - start > stage.timeout_s:
                    raise subprocess.TimeoutExpired(stage.command, stage.timeout_s)
            code = process.wait(timeout=max(1, stage.timeout_s - (time.perf_counter() - start)))
            # pytest: 5 = nothing selected (no CUDA tests), not a failure.
            stage.status = "ok" if code == 0 or (stage.kind == "tests" and code == 5) \
                else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            stage.status = f"timed out after {stage.timeout_s} s"
    stage.seconds = time.perf_counter() - start


def _benchmark_reuse(stages: list[Stage]) -> list[str]:
    """--reuse NAME=JSON for each benchmark that finished, so notebooks do not rerun it."""
    reuse = []
    for stage in stages:
        result = stage.out / f"{stage.name}.json"
        if stage.kind == "benchmark" and stage.status == "ok" and result.is_file():
            reuse += ["--reuse", f"{stage.name}={result}"]
    return reuse


def _headlines(out: Path, stages: list[Stage]) -> list[str]:
    """One line per stage that has a headline figure, read from the files the stages wrote."""
    lines = []
    env_file = out / "environment" / "environment.json"
    if env_file.is_file():
        env = json.loads(env_file.read_text())
        memory = f", {env['total_memory_bytes']:,} B" if "total_memory_bytes" in env else ""
        lines.append(f"- environment: {env['card']}{memory}; copy bandwidth "
                     f"{env['copy_gb_s']:,.1f} GB/s (measured in this run)")
    for stage in stages:
        result = stage.out / f"{stage.name}.json"
        if stage.kind == "benchmark" and result.is_file():
            goal = json.loads(result.read_text()).get("goal") or {}
            if goal:
                lines.append(f"- {stage.name}: {goal['pct_of_copy']:.1f} % of copy bandwidth, "
                             f"{goal['x_sdpa']:.2f}x SDPA's time at batch x context x block "
                             f"{goal['point']}")
        story = stage.out / f"{stage.name}.json"
        if stage.kind == "story" and story.is_file():  # every story is an oom_story run
            from ..oom_story.report import headline

            lines.append(headline(json.loads(story.read_text())))
    return lines


def write_summary(out: Path, stages: list[Stage], dry_run: bool, seconds: float,
                  notes: tuple[str, ...] = ()) -> str:
    """SUMMARY.md: mode, date, one row per stage (status, time, its summary file), headlines."""
    tests = [stage for stage in stages if stage.kind == "tests"]
    if tests:
        (tests[0].out / "tests.md").write_text(summarize_junit(tests[0].out / "junit.xml"))
    files = {"environment": "environment/environment.md", "tests": "tests/tests.md",
             "benchmark": "benchmarks/{name}.md", "story": "{name}/{name}.md",
             "notebook": "notebooks/{name}.md"}
    mode = ("dry run: CPU, toy sizes, Triton interpreter — not measured on a GPU" if dry_run
            else "GPU tour")
    lines = ["# kvlab GPU tour", "",
             f"{mode}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
             f"{seconds:.0f} s in all.", "", *_headlines(out, stages), *notes, "",
             "| stage | status | seconds | summary |", "|---|---|---|---|"]
    for stage in stages:
        summary = files[stage.kind].format(name=stage.name)
        link = f"[{summary}]({summary})" if (out / summary).is_file() else "—"
        lines.append(f"| {stage.name} | {stage.status} | {stage.seconds:.1f} | {link} |")
    text = "\n".join(lines) + "\n"
    (out / "SUMMARY.md").write_text(text)
    return text


def run_tour(repo: Path, out: Path, dry_run: bool = False, budget_s: float = 330,
             notebooks: list[str] | None = None, skip: tuple[str, ...] = (),
             notes: tuple[str, ...] = ()) -> Path:
    """Run every stage within budget_s seconds; returns the archive's path (<out>.tar.gz)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    env = _stage_env(dry_run)
    stages = plan_stages(repo, out, dry_run, notebooks, skip)
    print(f"kvlab GPU tour{' (dry run)' if dry_run else ''}: {len(stages)} stages -> {out}",
          flush=True)
    for number, stage in enumerate(stages, 1):
        left = budget_s - (time.perf_counter() - start)
        if left < MIN_STAGE_S:
            stage.status = f"skipped: {left:.0f} s of the {budget_s:.0f} s budget left"
            print(f"== {number}/{len(stages)} {stage.name}: {stage.status}", flush=True)
            continue
        stage.timeout_s = int(min(stage.timeout_s, left))
        if stage.kind == "notebook":  # the notebook stops itself a little before the hard limit
            stage.command += ["--timeout", str(max(1, stage.timeout_s - 5)),
                              *_benchmark_reuse(stages)]
        print(f"== {number}/{len(stages)} {stage.name} (limit {stage.timeout_s} s)", flush=True)
        _run_stage(stage, env, repo)
        print(f"== {stage.name}: {stage.status} in {stage.seconds:.1f} s", flush=True)
    print(write_summary(out, stages, dry_run, time.perf_counter() - start, notes), flush=True)
    archive = out.parent / f"{out.name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(f"archive: {archive} ({archive.stat().st_size:,} B)", flush=True)
    return archive


def main(argv: list[str] | None = None, repo: Path | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy sizes, Triton interpreter: the same harness, no GPU needed")
    parser.add_argument("--out", type=Path, default=None, help="folder for results")
    parser.add_argument("--budget", type=float, default=330, help="seconds for the whole tour")
    parser.add_argument("--notebooks", nargs="*", default=None, metavar="PREFIX",
                        help="only notebooks whose name starts with one of these (e.g. 02 04)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=("environment", "tests", "benchmark", "story", "notebook"))
    parser.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                        help="install missing packages from this folder of wheels first "
                             "(offline; default: the repository's .whl/ when it exists)")
    parser.add_argument("--repo", type=Path, default=repo or Path.cwd(),
                        help="repository root (holds notebooks/, tests/, kernels/)")
    args = parser.parse_args(argv)
    if not (args.repo / "notebooks").is_dir():
        print(f"gpu tour: error: {args.repo} has no notebooks/ folder; pass --repo",
              file=sys.stderr)
        return 2
    default_out = Path(tempfile.gettempdir()) / "kvlab-gpu-tour-dry-run"
    if not args.dry_run:
        import torch

        from ..device import card_slug

        if not torch.cuda.is_available():
            print("gpu tour: error: no CUDA GPU here; use --dry-run to run the harness on the CPU",
                  file=sys.stderr)
            return 2
        default_out = (args.repo / "results" / card_slug("cuda") /
                       f"gpu-tour-{datetime.date.today().isoformat()}")
    missing = missing_modules()
    wheels = args.wheels or (args.repo / ".whl" if (args.repo / ".whl").is_dir() else None)
    if missing and wheels is not None:
        print(f"gpu tour: installing {', '.join(missing)} from {wheels}", flush=True)
        install_wheels(wheels, missing)
        missing = missing_modules()
    if missing:  # stages that need them fail and say so; the others still run
        print(f"gpu tour: warning: cannot import {', '.join(missing)}; fetch wheels with "
              f"`bash scripts/gpu_tour_wheels.sh` where there is network, then pass "
              f"--wheels .whl", flush=True)
    out = args.out or default_out
    notes = (f"- missing here: {', '.join(missing)} (stages that need them failed)",) \
        if missing else ()
    run_tour(args.repo.resolve(), out.resolve(), args.dry_run, args.budget, args.notebooks,
             tuple(args.skip), notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
