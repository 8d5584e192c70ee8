"""`kvlab check N`: run a stage's exercise tests with pytest; print one line per failing test.

The grading is ordinary pytest tests, `tests/exercises/test_stageN.py`, which import the learner's
`stageN_*.py` from the folder in $KVLAB_EXERCISES_DIR (default `solutions/`; see that folder's
conftest.py). `Reporter` replaces pytest's own report: per failing test, the TODO hint still
waiting, the failed comparison (`kvlab.grading`: the input, expected vs got) or the exception and
the learner's line that raised it. How exercises are made and a stage is added:
`scripts/make_exercises.py`.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

ENV_EXERCISES_DIR = "KVLAB_EXERCISES_DIR"
ROOT = Path(__file__).resolve().parents[2]  # the course checkout (`pip install -e .`)


class Reporter:
    """A pytest plugin: each test's (PASS | SKIP | TODO | FAIL | ERROR, reason)."""

    def __init__(self, learner_dir: Path):
        self.learner_dir = learner_dir
        self.results: dict[str, tuple[str, str]] = {}  # pytest node id -> (kind, reason)
        self.broken: list[str] = []                    # test files that could not be collected

    def pytest_collectreport(self, report):
        if report.failed:
            last = report.longreprtext.strip().splitlines()[-1].removeprefix("E").strip()
            self.broken.append(f"{report.nodeid}: {last}")

    def pytest_runtest_logreport(self, report):
        if report.failed or report.skipped or report.when == "call":
            kind = "ERROR" if report.failed else "SKIP" if report.skipped else "PASS"
            self.results.setdefault(report.nodeid, (kind, ""))

    def pytest_exception_interact(self, node, call, report):
        error = call.excinfo.value
        frames = traceback.extract_tb(error.__traceback__)
        if isinstance(error, NotImplementedError) and str(error).startswith("TODO"):
            hint = str(error).split(":", 1)[-1].strip()
            self.results[report.nodeid] = "TODO", f"{frames[-1].name}(): {hint}"
        elif isinstance(error, AssertionError):  # line 1: the message; then pytest's "assert ..."
            self.results[report.nodeid] = "FAIL", (str(error).splitlines() or ["assert"])[0]
        else:
            mine = [f for f in frames if Path(f.filename).resolve().parent == self.learner_dir]
            where = "".join(f" ({Path(f.filename).name} line {f.lineno}: {f.line})"
                            for f in mine[-1:])
            self.results[report.nodeid] = "ERROR", f"{type(error).__name__}: {error}{where}"

    def summarize(self, learner_files: dict[int, Path]) -> bool:
        """Print each stage's failing tests (the cases of one test together) and its verdict."""
        for line in self.broken:
            print(f"kvlab check: could not load the tests {line}")
        all_pass = not self.broken
        for stage, learner_file in learner_files.items():
            print(f"Stage {stage}: {learner_file}")
            results, by_test = [], {}
            for nodeid, result in self.results.items():
                if f"test_stage{stage}.py::" in nodeid:
                    results.append(result)
                    by_test.setdefault(nodeid.split("::")[-1].split("[")[0], []).append(result)
            first_with: dict[str, str] = {}  # a reason -> the first test printed with it
            for name, cases in by_test.items():
                bad = [case for case in cases if case[0] not in ("PASS", "SKIP")]
                if bad:
                    kind, why = bad[0]
                    count = f" ({len(bad)} of {len(cases)} cases)" if len(cases) > 1 else ""
                    said = f"same as {first_with[why]}" if why in first_with else why
                    print(f"  {kind:5} {name}{count}: {said}")
                    first_with.setdefault(why, name)
            passed, skipped = (sum(kind == k for kind, _ in results) for k in ("PASS", "SKIP"))
            ok = passed > 0 and passed + skipped == len(results)  # all skipped: nothing checked
            print(f"Stage {stage}: {'PASS' if ok else 'NOT YET'} ({passed} of {len(results)} "
                  f"tests pass{f', {skipped} skipped' if skipped else ''})")
            all_pass &= ok
        return all_pass


def run_check(stage: str, target: str = "exercises") -> int:
    """Grade the `stageN_*.py` in `target` ("exercises", "solutions" or a folder) for stage "N"
    or "all"; print the summary. Returns 0 when every test passes, 1 if not, 2 without pytest.

    Raises:
        ValueError: no such stage. FileNotFoundError: no tests/exercises/, or no `target` folder.
    """
    try:
        import pytest
    except ImportError:
        print("kvlab check: error: pytest is not installed, and the checks are pytest tests: "
              "`pip install pytest hypothesis` (both are kvlab dependencies)", file=sys.stderr)
        return 2
    tests = {int(path.stem[len("test_stage"):]): path
             for path in (ROOT / "tests" / "exercises").glob("test_stage*.py")}
    if not tests:
        raise FileNotFoundError(f"no exercise tests in {ROOT}/tests/exercises: kvlab check runs "
                                f"in the course repository, installed with `pip install -e .`")
    if stage != "all" and (not stage.isdigit() or int(stage) not in tests):
        raise ValueError(f"no stage {stage!r}; stages with tests: {sorted(tests)} or 'all'")
    folder = ROOT / target if target in ("exercises", "solutions") else Path(target).resolve()
    folder = folder.parent if folder.is_file() else folder
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; give exercises, solutions or yours")
    os.environ[ENV_EXERCISES_DIR] = str(folder)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # nbval & co.: not needed, and slow
    wanted = sorted(tests) if stage == "all" else [int(stage)]
    reporter = Reporter(folder)
    code = pytest.main([*(str(tests[n]) for n in wanted), "-p", "no:terminal", "-p",
                        "no:cacheprovider", "-o", "addopts=", f"--rootdir={ROOT}"],
                       plugins=[reporter])
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    all_pass = reporter.summarize({n: shown / next(folder.glob(f"stage{n}_*.py"),
                                                   Path(f"stage{n}_*.py")).name for n in wanted})
    if code not in (0, 1):
        print(f"kvlab check: pytest stopped early (exit code {int(code)}); nothing was graded")
    return 0 if all_pass and code == 0 else 1
