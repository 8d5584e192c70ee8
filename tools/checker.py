"""`kvlab check N`: run the stage-N exercise tests on the learner's `stageN_*.py` (in the folder
$KVLAB_EXERCISES_DIR) and print one line per failing test: the TODO hint, the failed comparison
(`kvlab.tools.grading`: input, expected vs got) or the exception and the learner's line that
raised it.

The tests are the course repository's tests/exercises/, installed with kvlab as the subpackage
`kvlab.exercise_tests` (pyproject's package-dir), so grading works from any install: editable,
`pip install .`, or `pip install git+...` as Colab's first cell does. The learner's folder is
`--target`; "exercises" and "solutions" are looked for in the current directory and its parents
(a notebook runs from the clone's notebooks/), then in the checkout an editable install points at.

The tests run in a child process. Stage 5's kernels run in Triton's CPU interpreter, where a load
or store outside a tensor touches real memory and can kill Python outright ("Fatal Python error:
Aborted"); the child's crash becomes one FAIL line for the test that was running, and the tests
it had not reached run in a new child.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
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
    """A pytest plugin: `results` maps each test to (PASS | SKIP | TODO | FAIL | ERROR, reason).
    With `record`, each test's start and each result are also appended to that file as JSON
    lines, so that what a crashed process had found survives it."""

    def __init__(self, learner_dir: Path, record: Path | None = None):
        self.learner_dir, self.results, self.record = learner_dir, {}, record

    def _write(self, entry: dict) -> None:
        if self.record is not None:
            with open(self.record, "a", encoding="utf-8") as file:
                file.write(json.dumps(entry) + "\n")

    def _set(self, nodeid: str, result: tuple[str, str]) -> None:
        self.results[nodeid] = result
        self._write({"test": nodeid, "result": list(result)})

    def pytest_runtest_logstart(self, nodeid, location):
        self._write({"start": nodeid})

    def pytest_runtest_logreport(self, report):  # runs before pytest_exception_interact
        if (report.when == "call" or report.skipped) and report.nodeid not in self.results:
            self._set(report.nodeid, ("SKIP" if report.skipped else "PASS", ""))

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
        self._set(report.nodeid, result)

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
    reporter, code = run_in_children([str(tests[n]) for n in wanted], folder)
    passed = [reporter.print_stage(n) for n in wanted]
    if code not in (0, 1):
        print(f"kvlab check: pytest stopped early (exit code {int(code)}); the report is partial")
    return 0 if all(passed) and code == 0 else 1


# pytest's own exit codes (0 all passed ... 5 no tests); anything else, or a signal, is a crash.
PYTEST_EXIT_CODES = range(6)
CHILD = "import sys; from kvlab.tools.checker import child_main; sys.exit(child_main(sys.argv[1:]))"


def run_in_children(test_files: list[str], learner_dir: Path) -> tuple[Reporter, int]:
    """Run the tests in a child process; if it crashes, the test it was running FAILs with the
    crash's first line, and a new child runs the tests not yet run. Returns the results and
    pytest's exit code (1 if a test crashed)."""
    reporter, crashed = Reporter(learner_dir), False
    with tempfile.TemporaryDirectory(prefix="kvlab-check-") as scratch:
        record, done = Path(scratch) / "record.jsonl", Path(scratch) / "done.json"
        while True:
            done.write_text(json.dumps(sorted(reporter.results)))
            record.write_text("")
            child = subprocess.run([sys.executable, "-c", CHILD, str(learner_dir), str(record),
                                    str(done), *test_files], capture_output=True, text=True)
            running = None
            for line in record.read_text(encoding="utf-8").splitlines():
                entry = json.loads(line)
                if "start" in entry:
                    running = entry["start"]
                else:
                    reporter.results[entry["test"]] = tuple(entry["result"])
            if child.returncode in PYTEST_EXIT_CODES:
                return reporter, 1 if crashed and child.returncode in (0, 5) else child.returncode
            if running is None:  # (a test that crashed is not run again: each round ends one)
                print(f"kvlab check: the tests' process crashed before a test ran: {crash_line(child)}")
                return reporter, 3
            reporter.results[running] = ("FAIL", (
                f"Python crashed running this check ({crash_line(child)}): a load or store "
                f"outside its tensor? In Triton's CPU interpreter it reads or writes real memory "
                f"(on a GPU: an illegal memory access); mask every lane that is not yours"))
            crashed = True


def crash_line(child: subprocess.CompletedProcess) -> str:
    """The first line a crashed child wrote to stderr ("Fatal Python error: Aborted"), or its
    signal."""
    for line in child.stderr.splitlines():
        if line.strip():
            return line.strip()
    return f"exit code {child.returncode}"


def child_main(argv: list[str]) -> int:
    """The child: LEARNER_DIR RECORD DONE TEST_FILE...; runs the tests not listed in DONE (a JSON
    list of test ids), appending each start and result to RECORD."""
    import pytest

    learner_dir, record, done, *test_files = argv
    skip = set(json.loads(Path(done).read_text()))

    class SkipDone:
        def pytest_collection_modifyitems(self, config, items):
            kept = [item for item in items if item.nodeid not in skip]
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid in skip])
            items[:] = kept

    tests_dir = str(exercise_tests_dir())
    # The tests' own folder is the root and the last conftest.py: the same run whether kvlab was
    # installed editable (tests/conftest.py of the suite is not loaded) or not.
    options = ["-p", "no:terminal", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--rootdir={tests_dir}", f"--confcutdir={tests_dir}"]
    return int(pytest.main([*options, *test_files],
                           plugins=[Reporter(Path(learner_dir), Path(record)), SkipDone()]))
