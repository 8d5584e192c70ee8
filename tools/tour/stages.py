"""What each stage of the GPU tour runs, found from the repository so new stages join by themselves.

* tests: the test files that use the `cuda` mark (`pytest -m cuda` over them);
* benchmarks: every `tools/bench_*.py` that defines `main(argv)` and takes `--out` (and `--toy`
  for the dry run), e.g. stage 5's `bench_paged_attention.py`;
* stories: scripted GPU runs that are not notebooks (`STORIES`: modules with `main(argv)` taking
  `--out`, `--name` and `--dry-run`): stage 7's out-of-memory story, `kvlab.tools.oom_story`,
  before the notebooks, and its naive run again with expandable segments after them;
* notebooks: the `notebooks/NN_*.ipynb` that have a GPU cell (`notebook_runner.has_gpu_cells`;
  today 02, 04 and 05), one process each (a notebook that fills the GPU never starves the next).

A stage is a command line plus a folder for its files and a time limit in seconds. The limits are
sized for a lent GPU machine's 10-minute command inside a 15-minute lease (docs/gpu_tour.md): they
add up to the tour's default budget, so a tour whose every stage runs to its limit still ends in
time. The dry run's are DRY_RUN_SCALE times longer (a busy CPU, Triton's interpreter), and it
starts each stage through `kvlab.tools.tour.triton_compat`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

from .notebook_runner import has_gpu_cells

__all__ = ["Stage", "TIMEOUTS", "BUDGET_S", "DRY_RUN_SCALE", "cuda_test_files", "benchmark_modules",
           "notebook_files", "plan_stages", "summarize_junit"]

_CUDA_MARK = re.compile(r"\bmark\.cuda\b")
_MAIN = re.compile(r"^def main\(", re.MULTILINE)
# Seconds per stage on a GPU: a stage past its limit is killed, the next one starts. Notebooks by
# their number (one with no entry gets "notebook"). They add up to BUDGET_S, the whole tour.
# On the CPU 02 and 04 take 14 and 22 s (docs/instructor_notes.md); 05 compiles kernels on a GPU,
# and its section 9 compiles the decode loop twice more for sm_90 (~10 s), paid for by the
# environment stage (a copy and a sum of 2 GiB, ~2 s on an H200) and notebook 04.
TIMEOUTS = {"environment": 15, "tests": 70, "benchmark": 125, "oom_story": 70,
            "oom_story_expandable": 30, "02": 30, "04": 35, "05": 65, "notebook": 30}
BUDGET_S = 440  # with the watchdog's grace and the install, the command ends within 8 minutes
DRY_RUN_SCALE = 3
# (name, module, extra arguments, after the notebooks?). Each writes <out>/<name>/<name>.{json,md}.
# `--budget`: seconds per strategy, so each story ends inside its stage's limit. The
# expandable-segments rerun of the naive server (the allocator's answer to fragmentation) runs
# last, so it only takes time that the notebooks left over.
STORIES = [
    ("oom_story", "kvlab.tools.oom_story", ("--budget", "20"), False),
    ("oom_story_expandable", "kvlab.tools.oom_story",
     ("--strategies", "naive", "--expandable-segments", "--budget", "15"), True),
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
    """notebooks/NN_*.ipynb in order: those with GPU cells, or (`only`) those whose name starts
    with one of these prefixes, GPU cells or not."""
    found = sorted((repo / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if only:
        return [path for path in found if any(path.name.startswith(prefix) for prefix in only)]
    return [path for path in found if has_gpu_cells(path)]


def _limit(key: str, dry_run: bool) -> int:
    return TIMEOUTS.get(key, TIMEOUTS["notebook"]) * (DRY_RUN_SCALE if dry_run else 1)


def plan_stages(repo: Path, out: Path, dry_run: bool, notebooks: list[str] | None = None,
                skip: tuple[str, ...] = ()) -> list[Stage]:
    """Every stage, in the order they run: environment, tests, benchmarks, stories, notebooks,
    late stories."""
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

    def story_stages(late: bool) -> list[Stage]:
        return [Stage(name, "story", [*python, module, "--out", str(out / name), "--name",
                                      name, *extra, *dry], out / name, _limit(name, dry_run))
                for name, module, extra, after_notebooks in STORIES if after_notebooks == late]

    stages += story_stages(late=False)
    for path in notebook_files(repo, notebooks):
        stages.append(Stage(path.stem, "notebook",
                            [*python, "kvlab.tools.tour.notebook_runner", str(path),
                             "--out", str(out / "notebooks"), *dry],
                            out / "notebooks", _limit(path.name[:2], dry_run)))
    stages += story_stages(late=True)
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
