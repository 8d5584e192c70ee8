"""`kvlab check N`: run the stage-N exercise tests on the learner's `stageN_*.py` (in the folder
$KVLAB_EXERCISES_DIR) and print one line per failing test: the TODO hint, the failed comparison
(`kvlab.tools.grading`: input, expected vs got) or the exception and the learner's line that
raised it.

The tests are the course repository's tests/exercises/, installed with kvlab as the subpackage
`kvlab.exercise_tests` (pyproject's package-dir), so grading works from any install: editable,
`pip install .`, or `pip install git+...` as Colab's first cell does. The learner's folder is
`--target`; "exercises" and "solutions" are looked for in the current directory and its parents
(a notebook runs from the clone's notebooks/), then in the checkout an editable install points at.
"""

import os
import re
import sys
import traceback
from pathlib import Path

ENV_EXERCISES_DIR = "KVLAB_EXERCISES_DIR"
NAMED_FOLDERS = ("exercises", "solutions")


def exercise_tests_dir() -> Path:
    """The folder of the installed `kvlab.exercise_tests` (test_stageN.py and their conftest)."""
    from kvlab import exercise_tests

    return Path(exercise_tests.__file__).resolve().parent


def stage_tests() -> dict[int, Path]:
    """{stage number: its test file}. Raises FileNotFoundError if the install has none."""
    folder = exercise_tests_dir()
    tests = {int(path.stem[10:]): path for path in folder.glob("test_stage*.py")}
    if not tests:
        raise FileNotFoundError(f"no test_stage*.py in {folder}: reinstall kvlab")
    return tests


def exercise_files(test_file: Path) -> list[str]:
    """The learner's files a stage's tests grade: each `load_stage("stageN_topic.py")` they make."""
    return re.findall(r"""load_stage\(\s*["'](stage\d+_\w+\.py)["']""", test_file.read_text())


def learner_folder(target: str) -> Path:
    """The folder to grade: `target` itself, or for "exercises"/"solutions" the nearest such
    folder holding stage*_*.py, from the current directory up, then in the editable checkout.
    Raises FileNotFoundError naming where it looked."""
    if target not in NAMED_FOLDERS:
        folder = Path(target).resolve()
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder; give exercises, solutions or yours")
        return folder
    here = Path.cwd().resolve()
    checkout = exercise_tests_dir().parents[1]  # <repo>/tests/exercises in an editable install
    for place in (here, *here.parents, checkout):
        if any((place / target).glob("stage*_*.py")):
            return place / target
    raise FileNotFoundError(f"no {target}/ folder with stage*_*.py in {here} or above; run from "
                            f"your copy of the course, or give --target FOLDER")


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
    such stage) or FileNotFoundError (no `target` folder, or it lacks a file the stage grades)."""
    try:
        import pytest
    except ImportError:
        print("kvlab check: error: pytest is not installed, and the checks are pytest tests: "
              "`pip install pytest hypothesis` (both are kvlab dependencies)", file=sys.stderr)
        return 2
    tests = stage_tests()
    if stage != "all" and (not stage.isdigit() or int(stage) not in tests):
        raise ValueError(f"no stage {stage!r}; stages with tests: {sorted(tests)} or 'all'")
    wanted = sorted(tests) if stage == "all" else [int(stage)]
    folder = learner_folder(target)
    missing = [name for n in wanted for name in exercise_files(tests[n])
               if not (folder / name).is_file()]
    if missing:  # one line here, rather than the same FileNotFoundError from every test
        what, it = ("the file", "it") if len(missing) == 1 else ("the files", "them")
        raise FileNotFoundError(f"{folder} has no {', '.join(missing)} ({what} `kvlab check "
                                f"{stage}` grades); give --target the folder that holds {it}")
    os.environ[ENV_EXERCISES_DIR] = str(folder)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # nbval & co.: not needed, and slow
    reporter, tests_dir = Reporter(folder), str(exercise_tests_dir())
    # The tests' own folder is the root and the last conftest.py: the same run whether kvlab was
    # installed editable (tests/conftest.py of the suite is not loaded) or not.
    options = ["-p", "no:terminal", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--rootdir={tests_dir}", f"--confcutdir={tests_dir}"]
    code = pytest.main([*options, *(str(tests[n]) for n in wanted)], plugins=[reporter])
    passed = [reporter.print_stage(n) for n in wanted]
    if code not in (0, 1):
        print(f"kvlab check: pytest stopped early (exit code {int(code)}); the report is partial")
    return 0 if all(passed) and code == 0 else 1
