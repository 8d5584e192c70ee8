"""What each stage of the GPU tour runs, found from the repository so new stages join by themselves.

* tests: the test files that use the `cuda` mark (`pytest -m cuda` over them);
* benchmarks: every `tools/bench_*.py` that defines `main(argv)` and takes `--out` (and `--toy`
  for the dry run), e.g. stage 5's `bench_paged_attention.py`;
* stories: scripted GPU runs that are not notebooks (`STORIES`: modules with `main(argv)` taking
  `--out`, `--name` and `--dry-run`): stage 7's out-of-memory story, `kvlab.tools.oom_story`,
  before the notebooks;
* notebooks: every notebook of the course (`notebooks/NN_*.ipynb` and its continuations such as
  `04b_*.ipynb`), whole, in order, one process each (a notebook that fills the GPU never starves
  the next): the course's GPU edition, every model, cache and measurement on the card.

A stage is a command line plus a folder for its files and a time limit in seconds. The limits are
sized for a lent GPU machine's 10-minute command inside a 15-minute lease (docs/gpu_tour.md): they
add up to at most the tour's default budget, so a tour whose every stage runs to its limit still
ends in time (tests/test_gpu_tour.py checks the sum). The dry run's are DRY_RUN_SCALE times longer
(a busy CPU, Triton's interpreter, every notebook whole), and it starts each stage through
`kvlab.tools.tour.triton_compat`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

__all__ = ["Stage", "TIMEOUTS", "BUDGET_S", "DRY_RUN_SCALE", "cuda_test_files", "benchmark_modules",
           "notebook_files", "plan_stages", "summarize_junit"]

_CUDA_MARK = re.compile(r"\bmark\.cuda\b")
_MAIN = re.compile(r"^def main\(", re.MULTILINE)
# Seconds per stage on a GPU: a stage past its limit is killed, the next one starts. Notebooks by
# the part of their name before the first "_" (one with no entry gets "notebook"). Guesses until a
# GPU run measures them: on a GPU the models and caches are fast, and what takes time is Python
# (the simulator, the scheduler's loop), Triton's compiles (05, 05b; 05c compiles five sm_90
# variants and sweeps the layouts), the uptraining (03) and the decode sweeps (00). Stage 7's
# three notebooks get 55 s (its two had 50): 07 serves the tiny model only (20 s whole on 2 shared
# CPU cores), 07b the simulated replays (27-33 s there), 07c without vLLM (25 s there).
TIMEOUTS = {"environment": 15, "tests": 40, "benchmark": 70, "oom_story": 45,
            "00": 35, "02": 30, "03": 40, "05": 30, "05b": 45, "05c": 35,
            "07": 15, "07b": 20, "07c": 20, "notebook": 25}
BUDGET_S = 540  # with the watchdog's grace and the install, the command ends within 9.5 minutes
DRY_RUN_SCALE = 5  # the CPU runs every notebook whole: up to 2 minutes each
# (name, module, extra arguments). Each writes <out>/<name>/<name>.{json,md}.
# `--budget`: seconds per strategy, so the story ends inside its stage's limit. (Its rerun with
# expandable segments, `--strategies naive --expandable-segments`, is run by hand: the notebooks
# take the rest of the budget.)
STORIES = [
    ("oom_story", "kvlab.tools.oom_story", ("--budget", "15")),
]


@dataclasses.dataclass
class Stage:
    """name: shown in progress and the summary, and its log's name (letters, digits, '_', so
    every file name travels); command: argv; out: its folder; timeout_s: limit; kind:
    'environment', 'tests', 'benchmark', 'story' or 'notebook'."""

    name: str
    kind: str
    command: list[str]
    out: Path
    timeout_s: int
    status: str = "not run"
    seconds: float = 0.0


def cuda_test_files(repo: Path) -> list[Path]:
    """tests/**/test_*.py files that mention `mark.cuda` (so pytest collects only those)."""
    return sorted(path for path in (repo / "tests").rglob("test_*.py")
                  if _CUDA_MARK.search(path.read_text(errors="replace")))


def benchmark_modules(repo: Path) -> list[str]:
    """Module names (kvlab.tools.<stem>) of tools/bench_*.py files that define main()."""
    return [f"kvlab.tools.{path.stem}" for path in sorted((repo / "tools").glob("bench_*.py"))
            if _MAIN.search(path.read_text(errors="replace"))]


def notebook_files(repo: Path, only: list[str] | None = None) -> list[Path]:
    """Every notebooks/NN*_*.ipynb in order (04_ before 04b_), or (`only`) those whose name starts
    with one of these prefixes."""
    found = sorted((repo / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    if only:
        return [path for path in found if any(path.name.startswith(prefix) for prefix in only)]
    return found


def _limit(key: str, dry_run: bool) -> int:
    return TIMEOUTS.get(key, TIMEOUTS["notebook"]) * (DRY_RUN_SCALE if dry_run else 1)


def plan_stages(repo: Path, out: Path, dry_run: bool, notebooks: list[str] | None = None,
                skip: tuple[str, ...] = ()) -> list[Stage]:
    """Every stage, in the order they run: environment, tests, benchmarks, stories, notebooks."""
    # The dry run starts each module through the launcher that fixes Triton's interpreter.
    python = [sys.executable, "-m", "kvlab.tools.tour.triton_compat"] if dry_run else \
        [sys.executable, "-m"]
    dry = ["--dry-run"] if dry_run else []
    stages = [Stage("environment", "environment",
                    [*python, "kvlab.tools.tour.environment", "--out", str(out / "environment"),
                     *dry],
                    out / "environment", _limit("environment", dry_run))]
    tests = cuda_test_files(repo)
    if tests:  # -v: a stage killed at its limit still shows each test done; -p no:nbval: the
        # notebooks' pytest plugin needs Jupyter, and is not for this
        stages.append(Stage(
            "cuda_tests", "tests",
            [*python, "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:nbval",
             "-v", "-m", "cuda", "-rs", f"--junitxml={out / 'tests' / 'junit.xml'}",
             *map(str, tests)],
            out / "tests", _limit("tests", dry_run)))
    for module in benchmark_modules(repo):
        stages.append(Stage(module.rsplit(".", 1)[1], "benchmark",
                            [*python, module, "--out", str(out / "benchmarks"),
                             *(["--toy"] if dry_run else [])],
                            out / "benchmarks", _limit("benchmark", dry_run)))
    stages += [Stage(name, "story", [*python, module, "--out", str(out / name), "--name", name,
                                     *extra, *dry], out / name, _limit(name, dry_run))
               for name, module, extra in STORIES]
    for path in notebook_files(repo, notebooks):
        stages.append(Stage(path.stem, "notebook",
                            [*python, "kvlab.tools.tour.notebook_runner", str(path),
                             "--out", str(out / "notebooks")],
                            out / "notebooks", _limit(path.name.split("_")[0], dry_run)))
    return [stage for stage in stages if stage.kind not in skip]


def summarize_junit(path: Path) -> str:
    """Markdown: counts and one row per test from pytest's JUnit XML (missing file: says so)."""
    if not path.is_file():
        return "# CUDA tests\n\nNo JUnit report was written (the stage did not finish).\n"
    root = ElementTree.parse(path).getroot()
    rows, counts = [], {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
        reason = ""
        if outcome != "passed":
            detail = next(iter(case), None)
            reason = (detail.get("message") or "")[:120].replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {case.get('classname')}.{case.get('name')} | {outcome} | "
                    f"{float(case.get('time', 0)):.2f} | {reason} |")
    lines = ["# CUDA tests (`pytest -m cuda`)", "",
             f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped.",
             "", "| test | outcome | seconds | reason |", "|---|---|---|---|", *rows]
    return "\n".join(lines) + "\n"
