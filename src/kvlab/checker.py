"""`kvlab check N`: run tests/exercises/test_stageN.py on the learner's `stageN_*.py` (in the folder
$KVLAB_EXERCISES_DIR) and print one line per failing test: the TODO hint, the failed comparison
(`kvlab.grading`: input, expected vs got) or the exception and the learner's line that raised it."""

import os
import sys
import traceback
from pathlib import Path

ENV_EXERCISES_DIR = "KVLAB_EXERCISES_DIR"
ROOT = Path(__file__).resolve().parents[2]  # the course checkout (`pip install -e .`)


class Reporter:
    """A pytest plugin: `results` maps each test to (PASS | SKIP | TODO | FAIL | ERROR, reason)."""

    def __init__(self, learner_dir: Path):
        self.learner_dir, self.results = learner_dir, {}

    def pytest_runtest_logreport(self, report):  # runs before pytest_exception_interact
        if report.when == "call" or report.skipped:
            self.results.setdefault(report.nodeid, ("SKIP" if report.skipped else "PASS", ""))

    def pytest_exception_interact(self, node, call, report):  # a test or a test file failed
        error = call.excinfo.value
        frames = traceback.extract_tb(error.__traceback__)
        message = (str(error).splitlines() or [""])[0]  # then, for a FAIL, pytest's "assert ..."
        if isinstance(error, NotImplementedError) and message.startswith("TODO"):
            result = "TODO", f"{frames[-1].name}(): {message.split(':', 1)[-1].strip()}"
        elif isinstance(error, AssertionError):
            result = "FAIL", message
        else:
            mine = [f for f in frames if Path(f.filename).resolve().parent == self.learner_dir]
            where = [f" ({Path(f.filename).name} line {f.lineno}: {f.line})" for f in mine]
            result = "ERROR", f"{type(error).__name__}: {message}{''.join(where[-1:])}"
        self.results[report.nodeid] = result

    def print_stage(self, stage: int) -> bool:
        """Print the verdict, then one line per failing test function; True if the stage passes."""
        by_test, said = {}, {}  # test function -> its cases' results; reason -> "same as <test>"
        for nodeid, result in self.results.items():
            if f"_stage{stage}.py" in nodeid:
                by_test.setdefault(nodeid.split("::")[-1].split("[")[0], []).append(result)
        kinds = [kind for cases in by_test.values() for kind, _ in cases]
        passed, skipped = kinds.count("PASS"), kinds.count("SKIP")
        ok = passed > 0 and passed + skipped == len(kinds)  # all skipped: nothing was checked
        print(f"Stage {stage}: {'PASS' if ok else 'NOT YET'} ({passed} of {len(kinds)} tests pass"
              f"{f', {skipped} skipped' if skipped else ''})")
        for name, cases in by_test.items():
            bad = [(kind, why) for kind, why in cases if kind not in ("PASS", "SKIP")]
            for kind, why in bad[:1]:  # the first failing case speaks for the others
                count = f" ({len(bad)} of {len(cases)} cases)" if len(cases) > 1 else ""
                print(f"  {kind:5} {name}{count}: {said.get(why, why)}")
                said.setdefault(why, f"same as {name}")
        return ok


def run_check(stage: str, target: str = "exercises") -> int:
    """Grade the `stageN_*.py` in `target` ("exercises", "solutions" or a folder) for stage "N"
    or "all"; returns 0 when every test passes, 1 if not, 2 without pytest. Raises ValueError (no
    such stage) or FileNotFoundError (no tests/exercises/, no `target` folder)."""
    try:
        import pytest
    except ImportError:
        print("kvlab check: error: pytest is not installed, and the checks are pytest tests: "
              "`pip install pytest hypothesis` (both are kvlab dependencies)", file=sys.stderr)
        return 2
    tests = {int(path.stem[10:]): path for path in ROOT.glob("tests/exercises/test_stage*.py")}
    if not tests:  # kvlab was not installed from the course repository with `pip install -e .`
        raise FileNotFoundError(f"no exercise tests in {ROOT}/tests/exercises (pip install -e .)")
    if stage != "all" and (not stage.isdigit() or int(stage) not in tests):
        raise ValueError(f"no stage {stage!r}; stages with tests: {sorted(tests)} or 'all'")
    folder = ROOT / target if target in ("exercises", "solutions") else Path(target).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; give exercises, solutions or yours")
    os.environ[ENV_EXERCISES_DIR] = str(folder)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # nbval & co.: not needed, and slow
    wanted, reporter = sorted(tests) if stage == "all" else [int(stage)], Reporter(folder)
    options = ["-p", "no:terminal", "-p", "no:cacheprovider", "-o", "addopts=", f"--rootdir={ROOT}"]
    code = pytest.main([*options, *(str(tests[n]) for n in wanted)], plugins=[reporter])
    passed = [reporter.print_stage(n) for n in wanted]
    if code not in (0, 1):
        print(f"kvlab check: pytest stopped early (exit code {int(code)}); the report is partial")
    return 0 if all(passed) and code == 0 else 1
