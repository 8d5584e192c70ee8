"""The exercises: learner files generated from the answers, and the checker that grades them.

Each stage has one reference answer, `solutions/stageN_<topic>.py`, written once. The parts a
learner writes are fenced by markers (the `hint:` text is optional and may go on over the
`# hint:` lines that follow the BEGIN line):

    def kv_cache_bytes(batch, seq_len, bytes_per_token):
        \"\"\"docstring with shapes and units\"\"\"
        # BEGIN SOLUTION hint: every token of every request costs bytes_per_token
        return batch * seq_len * bytes_per_token
        # END SOLUTION

`write_exercises` turns each answer into `exercises/stageN_<topic>.py`, where every fenced block
becomes one line at the same indentation,

        raise NotImplementedError("TODO(stage 0): every token of every request costs ...")

so the two files cannot drift apart (`exercises_up_to_date` is the CI check that they have not).
A file the learner has edited is never overwritten unless `force=True`: each generated file
records a checksum of what was generated, and a file whose text no longer matches it is theirs.

`check_stage` grades a stage: it runs `tests/exercises/test_stageN.py` with pytest in a fresh
Python process, with the environment variable `KVLAB_EXERCISES_DIR` naming the folder whose
`stageN_*.py` the tests import (`exercises/`, `solutions/`, or any folder of the learner's), and
prints a line per test function (its parametrized cases together): PASS, FAIL (a wrong answer:
which input, expected vs got), TODO (a `NotImplementedError` still in place: where, and its
hint), ERROR (an exception in the learner's code: which line), or once per stage CANNOT IMPORT
(e.g. a syntax error in the learner's file). It never raises for anything the learner wrote and
never shows the harness's own tracebacks; it returns an exit code.

Adding a stage needs no change here: add `solutions/stageN_<topic>.py` with markers and
`tests/exercises/test_stageN.py` (a module fixture `ex` that returns
`load_stage("stageN_<topic>.py")`, and asserts written with `assert_equal`, `assert_close`,
`expect_raises` below so every failure names its input), then run `kvlab exercises --write`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

__all__ = [
    "ExerciseError", "ExerciseImportError", "find_root", "solution_files", "stage_numbers",
    "make_exercise", "write_exercises", "WriteReport", "exercises_up_to_date", "load_exercise",
    "check_stage", "classify_exception", "assert_close", "assert_equal", "expect_raises",
    "ENV_EXERCISES_DIR", "ENV_CHECK_REPORT",
]

# The folder whose stageN_*.py the tests in tests/exercises/ import (default there: solutions/).
ENV_EXERCISES_DIR = "KVLAB_EXERCISES_DIR"
# Where tests/exercises/conftest.py writes its per-test report for `check_stage` (JSON lines).
ENV_CHECK_REPORT = "KVLAB_CHECK_REPORT"

BEGIN_MARKER = "# BEGIN SOLUTION"
END_MARKER = "# END SOLUTION"
HINT_LINE = "# hint:"
CHECKSUM_TAG = "# kvlab-exercise-checksum:"
DEFAULT_HINT = "implement this"

_STAGE_FILE = re.compile(r"^stage(\d+)_\w+\.py$")
_TEST_FILE = re.compile(r"^test_stage(\d+)\.py$")


class ExerciseError(ValueError):
    """The exercise files cannot be generated or found (the message names the file and line)."""


class ExerciseImportError(Exception):
    """A learner's stage file could not be imported: missing, a syntax error, an error at import."""


# ---- finding things ---------------------------------------------------------------------------

def find_root(start: str | Path | None = None) -> Path:
    """The course folder: the nearest of `start` (default: the current directory) and its parents
    that holds both `solutions/` and `exercises/`.

    Raises:
        ExerciseError: no such folder above `start`.
    """
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "solutions").is_dir() and (folder / "exercises").is_dir():
            return folder
    raise ExerciseError(f"no kvlab course folder (one holding solutions/ and exercises/) at or "
                        f"above {here}; run this inside the course repository")


def _root(root: str | Path | None) -> Path:
    return Path(root).resolve() if root is not None else find_root()


def solution_files(root: str | Path | None = None) -> dict[int, Path]:
    """Stage number -> its answer file `solutions/stageN_<topic>.py`, in stage order.

    Raises:
        ExerciseError: two answer files for one stage.
    """
    root = _root(root)
    found: dict[int, Path] = {}
    for path in sorted((root / "solutions").glob("stage*_*.py")):
        match = _STAGE_FILE.match(path.name)
        if not match:
            continue
        stage = int(match.group(1))
        if stage in found:
            raise ExerciseError(f"two answer files for stage {stage}: {found[stage].name} and "
                                f"{path.name}")
        found[stage] = path
    return dict(sorted(found.items()))


def stage_numbers(root: str | Path | None = None) -> list[int]:
    """Stages that have tests (`tests/exercises/test_stageN.py`), in order."""
    root = _root(root)
    stages = []
    for path in (root / "tests" / "exercises").glob("test_stage*.py"):
        match = _TEST_FILE.match(path.name)
        if match:
            stages.append(int(match.group(1)))
    return sorted(stages)


# ---- generating the learner files -------------------------------------------------------------

def _string_literal(text: str) -> str:
    """A Python string literal for `text`, double-quoted where that needs no escapes."""
    if '"' not in text and "\\" not in text and text.isprintable():
        return f'"{text}"'
    return repr(text)


def _strip_solutions(source: str, stage: int, name: str) -> str:
    """Replace every BEGIN/END SOLUTION block of `source` with a `raise NotImplementedError`."""
    out: list[str] = []
    lines = source.splitlines()
    index, blocks = 0, 0
    while index < len(lines):
        line = lines[index]
        stripped = line.strip()
        if stripped.startswith(END_MARKER):
            raise ExerciseError(f"{name}:{index + 1}: '{END_MARKER}' without a '{BEGIN_MARKER}' "
                                f"before it")
        if not stripped.startswith(BEGIN_MARKER):
            out.append(line)
            index += 1
            continue

        # A block: BEGIN line (with an optional hint), `# hint:` continuation lines, code, END.
        begin_line = index + 1
        indent = line[: len(line) - len(line.lstrip())]
        rest = stripped[len(BEGIN_MARKER):].strip()
        hint_parts = []
        if rest:
            if not rest.startswith("hint:"):
                raise ExerciseError(f"{name}:{begin_line}: write '{BEGIN_MARKER} hint: <text>', "
                                    f"got {stripped!r}")
            hint_parts.append(rest[len("hint:"):].strip())
        index += 1
        while index < len(lines) and lines[index].strip().startswith(HINT_LINE):
            hint_parts.append(lines[index].strip()[len(HINT_LINE):].strip())
            index += 1
        while True:
            if index == len(lines):
                raise ExerciseError(f"{name}:{begin_line}: '{BEGIN_MARKER}' is never closed by "
                                    f"'{END_MARKER}'")
            inner = lines[index].strip()
            if inner.startswith(BEGIN_MARKER):
                raise ExerciseError(f"{name}:{index + 1}: '{BEGIN_MARKER}' inside the block "
                                    f"opened at line {begin_line}; blocks do not nest")
            if inner.startswith(END_MARKER):
                end_indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
                if end_indent != indent:
                    raise ExerciseError(f"{name}:{index + 1}: '{END_MARKER}' is not indented like "
                                        f"its '{BEGIN_MARKER}' at line {begin_line}")
                index += 1
                break
            index += 1
        hint = " ".join(part for part in hint_parts if part) or DEFAULT_HINT
        message = _string_literal(f"TODO(stage {stage}): {hint}")
        out.append(f"{indent}raise NotImplementedError({message})")
        blocks += 1
    if blocks == 0:
        raise ExerciseError(f"{name}: no '{BEGIN_MARKER}' blocks, so the exercise would have "
                            f"nothing to do")
    return "\n".join(out) + "\n"


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:16]


def _header(stage: int, source_name: str, body: str) -> str:
    return (
        f"# Stage {stage} exercise, GENERATED from solutions/{source_name} by "
        f"`kvlab exercises --write`.\n"
        f"# Your work goes here: replace each `raise NotImplementedError(\"TODO(stage {stage}): "
        f"...\")` with\n"
        f"# your code, then run `kvlab check {stage}`. Re-generating keeps a file you have "
        f"edited (unless --force).\n"
        f"{CHECKSUM_TAG} {_checksum(body)}\n"
        f"\n"
    )


def make_exercise(source: str, stage: int, source_name: str) -> str:
    """The learner version of an answer file's text: header + every solution block replaced.

    Args:
        source: text of `solutions/<source_name>`.
        stage: the stage number, written into each TODO message.
        source_name: the answer file's name, for the header and error messages.

    Returns:
        The text of `exercises/<source_name>`.

    Raises:
        ExerciseError: unbalanced or nested markers, an END indented unlike its BEGIN, a file
            with no blocks, or a result that is not valid Python.
    """
    body = _strip_solutions(source, stage, source_name)
    try:
        compile(body, f"exercises/{source_name}", "exec", dont_inherit=True)
    except SyntaxError as error:
        raise ExerciseError(f"the exercise generated from {source_name} is not valid Python "
                            f"(line {error.lineno}: {error.msg}); check its markers") from error
    return _header(stage, source_name, body) + body


def _is_untouched(text: str) -> bool:
    """True when a generated exercise file still holds exactly what was generated."""
    head, sep, body = text.partition("\n\n")
    for line in head.splitlines():
        if line.startswith(CHECKSUM_TAG):
            return sep != "" and line[len(CHECKSUM_TAG):].strip() == _checksum(body)
    return False


@dataclasses.dataclass
class WriteReport:
    """What `write_exercises` did, file by file."""

    written: list[Path] = dataclasses.field(default_factory=list)
    unchanged: list[Path] = dataclasses.field(default_factory=list)
    kept_edited: list[Path] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """Lines for the CLI to print."""
        lines = [f"wrote {path}" for path in self.written]
        lines += [f"up to date {path}" for path in self.unchanged]
        lines += [f"kept {path}: you have edited it (--force overwrites it with a fresh copy)"
                  for path in self.kept_edited]
        return "\n".join(lines)


def write_exercises(root: str | Path | None = None, force: bool = False) -> WriteReport:
    """Generate `exercises/stageN_*.py` from every `solutions/stageN_*.py`.

    A file is rewritten when it is missing or still exactly as generated before; a file the
    learner has edited is kept (listed in `kept_edited`) unless `force`.

    Raises:
        ExerciseError: no course folder, or bad markers in an answer file (nothing is written
            then: every file is generated before any is written).
    """
    root = _root(root)
    generated = {}
    for stage, source in solution_files(root).items():
        text = make_exercise(source.read_text(encoding="utf-8"), stage, source.name)
        generated[root / "exercises" / source.name] = text
    report = WriteReport()
    for target, text in generated.items():
        if target.exists():
            current = target.read_text(encoding="utf-8")
            if current == text:
                report.unchanged.append(target)
                continue
            if not force and not _is_untouched(current):
                report.kept_edited.append(target)
                continue
        target.write_text(text, encoding="utf-8", newline="\n")
        report.written.append(target)
    return report


def edited_exercises(root: str | Path | None = None) -> list[Path]:
    """Exercise files the learner has edited (their text no longer matches its checksum)."""
    root = _root(root)
    return [path for path in sorted((root / "exercises").glob("stage*_*.py"))
            if _STAGE_FILE.match(path.name)
            and not _is_untouched(path.read_text(encoding="utf-8"))]


def exercises_up_to_date(root: str | Path | None = None,
                         include_edited: bool = False) -> list[Path]:
    """The exercise files that do not match their answer files (an empty list: all up to date).

    Lists missing and out-of-date `exercises/stageN_*.py`, and exercise files with no answer file.
    A file the learner has edited is their work, not staleness: it is left out unless
    `include_edited` (the course's own CI sets it: the committed files must be pristine).

    Raises:
        ExerciseError: no course folder, or bad markers in an answer file.
    """
    root = _root(root)
    stale = []
    expected = set()
    edited = set() if include_edited else set(edited_exercises(root))
    for stage, source in solution_files(root).items():
        target = root / "exercises" / source.name
        expected.add(target)
        if target in edited:
            continue
        text = make_exercise(source.read_text(encoding="utf-8"), stage, source.name)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            stale.append(target)
    for path in sorted((root / "exercises").glob("stage*_*.py")):
        if _STAGE_FILE.match(path.name) and path not in expected:
            stale.append(path)
    return stale


# ---- loading a learner's file (used by tests/exercises) ---------------------------------------

def _where_in(error: BaseException, path: Path) -> str:
    """' (stage0_kv_size.py line 12, in f: <code>)' for the deepest frame of `error` in `path`."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if Path(frame.filename).resolve() == path]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": {frame.line.strip()}" if frame.line else ""
    return f" ({path.name} line {frame.lineno}, in {frame.name}{code})"


_loaded: dict[Path, types.ModuleType | ExerciseImportError] = {}


def load_exercise(filename: str, directory: str | Path) -> types.ModuleType:
    """Import a learner's `directory/filename` as a fresh module (once per process).

    The file is compiled from its source every time a process loads it (no cached bytecode, so an
    edit is always seen).

    Raises:
        ExerciseImportError: the file is missing, has a syntax error, or raises while importing;
            the message says which and where.
    """
    path = (Path(directory) / filename).resolve()
    cached = _loaded.get(path)
    if isinstance(cached, ExerciseImportError):
        raise cached
    if cached is not None:
        return cached
    try:
        module = _import_file(path)
    except ExerciseImportError as error:
        _loaded[path] = error
        raise
    _loaded[path] = module
    return module


def _import_file(path: Path) -> types.ModuleType:
    if not path.is_file():
        raise ExerciseImportError(f"there is no file {path}")
    name = f"kvlab_exercise_{path.parent.name}_{path.stem}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    try:
        source = path.read_text(encoding="utf-8")
        code = compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as error:
        text = f": {error.text.strip()}" if error.text else ""
        raise ExerciseImportError(f"{path.name} line {error.lineno}: {type(error).__name__}: "
                                  f"{error.msg}{text}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ExerciseImportError(f"cannot read {path}: {error}") from None
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        exec(code, module.__dict__)
    except BaseException as error:  # noqa: BLE001 - report anything the learner's file raises
        sys.modules.pop(name, None)
        if isinstance(error, KeyboardInterrupt):
            raise
        raise ExerciseImportError(f"importing {path.name} raised {type(error).__name__}: "
                                  f"{error}{_where_in(error, path)}") from None
    return module


# ---- assertions with readable messages (used by tests/exercises) ------------------------------

def _describe(value: Any) -> str:
    try:
        import torch
        if isinstance(value, torch.Tensor):
            return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def assert_equal(got: Any, expected: Any, what: str) -> None:
    """Exact equality, failing with "<what>: expected <expected>, got <got>".

    Ints are shown with thousands separators; a bool is never accepted for an int.
    """
    def show(value):
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return _describe(value)

    if type(got) is bool and type(expected) is not bool:
        raise AssertionError(f"{what}: expected {show(expected)}, got {got!r} (a bool)")
    if got != expected:
        raise AssertionError(f"{what}: expected {show(expected)}, got {show(got)}")


def assert_close(got: Any, expected: Any, what: str, atol: float = 1e-6,
                 rtol: float = 1e-6) -> None:
    """Check a tensor result: type, shape, dtype, then |got - expected| <= atol + rtol |expected|.

    The failure names `what`, the first check that failed and, for values, the worst element:
    "rms_norm(x [4, 16] float32): at [2, 5] expected 0.8134, got 0.7962 (tolerance 1.8e-06)".
    """
    import torch

    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected {_describe(expected)}, got {_describe(got)}")
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: expected shape {list(expected.shape)}, got "
                             f"{list(got.shape)}")
    if got.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected dtype {expected.dtype}, got {got.dtype}")
    got64, expected64 = got.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(got64).all() and torch.isfinite(expected64).all():
        index = tuple(int(i) for i in (~torch.isfinite(got64)).nonzero()[0])
        raise AssertionError(f"{what}: got a non-finite value {got64[index].item()} at "
                             f"{list(index)}, expected {expected64[index].item():.6g}")
    excess = (got64 - expected64).abs() - (atol + rtol * expected64.abs())
    if got64.numel() and excess.max() > 0:
        flat = int(excess.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got64.shape))
        g, e = got64[index].item(), expected64[index].item()
        bad = int((excess > 0).sum())
        raise AssertionError(
            f"{what}: {bad} of {got64.numel()} values differ; worst at {list(index)}: expected "
            f"{e:.6g}, got {g:.6g} (tolerance {atol + rtol * abs(e):.2g})")


def expect_raises(error_type: type[BaseException], call: Callable[[], Any],
                  what: str) -> BaseException:
    """Call `call()` and return the `error_type` it raises; fail readably when it does not.

    A `NotImplementedError("TODO...")` passes through untouched, so the checker shows it as a TODO.
    """
    try:
        result = call()
    except error_type as error:
        return error
    except NotImplementedError as error:
        if str(error).startswith("TODO"):
            raise
        raise AssertionError(f"{what}: expected {error_type.__name__}, got "
                             f"NotImplementedError: {error}") from None
    except Exception as error:  # noqa: BLE001 - the wrong exception is the finding
        raise AssertionError(f"{what}: expected {error_type.__name__}, got "
                             f"{type(error).__name__}: {error}") from None
    raise AssertionError(f"{what}: expected {error_type.__name__} to be raised, but it returned "
                         f"{_describe(result)}")


# ---- the checker ------------------------------------------------------------------------------

def classify_exception(error: BaseException, learner_dir: str | Path | None = None) -> dict:
    """{'kind': 'todo' | 'import' | 'fail' | 'error', 'message': ...} for a failed test.

    Used by tests/exercises/conftest.py to write the report `check_stage` reads.
    """
    text = str(error)
    if isinstance(error, NotImplementedError) and text.startswith("TODO"):
        hint = text.split(":", 1)[1].strip() if ":" in text else text
        frames = traceback.extract_tb(error.__traceback__)
        return {"kind": "todo", "message": hint, "function": frames[-1].name if frames else ""}
    if isinstance(error, ExerciseImportError) or type(error).__name__ == "ExerciseImportError":
        return {"kind": "import", "message": text}
    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", ()) or ())
    if isinstance(error, AssertionError) or type(error).__name__ == "Failed":
        # pytest appends its own "assert a == b" explanation after our message; drop it.
        lines = text.splitlines()
        kept = []
        for line in lines:
            if line.startswith("assert ") and kept:
                break
            kept.append(line)
        message = "\n".join(kept).strip() or "an assertion failed"
        return {"kind": "fail", "message": message + notes}
    where = ""
    if learner_dir is not None:
        directory = Path(learner_dir).resolve()
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if Path(frame.filename).resolve().parent == directory]
        if frames:
            frame = frames[-1]
            code = f": {frame.line.strip()}" if frame.line else ""
            where = f"\n(in {frame.name}, {Path(frame.filename).name} line {frame.lineno}{code})"
    return {"kind": "error", "message": f"{type(error).__name__}: {text}{where}{notes}"}


_LABELS = {"pass": "PASS", "fail": "FAIL", "todo": "TODO", "error": "ERROR", "skip": "SKIP"}


def _indent(text: str, prefix: str = "        ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _display(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _resolve_target(target: str | Path, root: Path) -> Path:
    if str(target) in ("exercises", "solutions"):
        return root / str(target)
    path = Path(target).expanduser().resolve()
    return path.parent if path.is_file() else path


def _read_report(path: Path) -> list[dict]:
    entries = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return entries


def check_stage(stage: int | str, target: str | Path = "exercises",
                root: str | Path | None = None, *, out: TextIO | None = None,
                timeout: float = 600) -> int:
    """Grade a learner's work for one stage (or "all") and print a readable summary.

    Runs pytest on `tests/exercises/test_stageN.py` in a subprocess, with `KVLAB_EXERCISES_DIR`
    set to the target folder, and prints per test PASS / FAIL / TODO / ERROR with the reason.

    Args:
        stage: a stage number (an int or a string of digits), or "all".
        target: "exercises" (the learner's files, default), "solutions" (the reference answers),
            or a path to a folder (or a file in the folder) holding `stageN_*.py` files.
        root: the course folder; default: found from the current directory (`find_root`).
        out: where to print; default sys.stdout.
        timeout: seconds before the test run is stopped (an endless loop counts as a failure).

    Returns:
        0 when every test of the stage(s) passes, 1 when any fails (or the run could not
        complete), 2 for a bad request (no course folder, unknown stage, missing target folder).
        Never raises for anything in the learner's code.
    """
    out = out or sys.stdout
    try:
        root = _root(root)
        stages = stage_numbers(root)
        answers = solution_files(root)
    except ExerciseError as error:
        print(f"kvlab check: {error}", file=out)
        return 2
    if not stages:
        print(f"kvlab check: no stage tests in {root / 'tests' / 'exercises'}", file=out)
        return 2
    if str(stage).lower() == "all":
        wanted = stages
    else:
        try:
            number = int(stage)
        except (TypeError, ValueError):
            number = None
        if number not in stages:
            print(f"kvlab check: no stage {stage!r}; stages with tests: "
                  f"{', '.join(map(str, stages))} (or 'all')", file=out)
            return 2
        wanted = [number]
    directory = _resolve_target(target, root)
    if not directory.is_dir():
        print(f"kvlab check: {directory} is not a folder (give 'exercises', 'solutions' or a "
              f"folder holding your stageN_*.py files)", file=out)
        return 2

    test_files = [root / "tests" / "exercises" / f"test_stage{n}.py" for n in wanted]
    with tempfile.TemporaryDirectory(prefix="kvlab-check-") as scratch:
        report_path = Path(scratch) / "report.jsonl"
        env = dict(os.environ)
        env[ENV_EXERCISES_DIR] = str(directory)
        env[ENV_CHECK_REPORT] = str(report_path)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        # The exercise tests need no third-party pytest plugins; not loading them (nbval pulls
        # in jsonschema, hypothesis its own machinery) saves seconds per check.
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        env.pop("PYTEST_ADDOPTS", None)
        # The project's own addopts (notebook options among them) are not for this run.
        command = [sys.executable, "-m", "pytest", *map(str, test_files), "-o", "addopts=",
                   "-q", "--tb=short", "--color=no", "-p", "no:cacheprovider"]
        try:
            run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                 timeout=timeout)
            returncode, output = run.returncode, run.stdout + run.stderr
        except subprocess.TimeoutExpired:
            returncode, output = None, ""
        except OSError as error:
            print(f"kvlab check: could not start pytest: {error}", file=out)
            return 1
        entries = _read_report(report_path)

    if returncode is None:
        print(f"kvlab check: the tests did not finish within {timeout:g} s (an endless loop in "
              f"your code?)", file=out)
        return 1
    return _print_summary(wanted, entries, returncode, output, directory, answers, root, out)


def _print_group(name: str, items: list[dict], shown: set, out: TextIO) -> None:
    """One test function's result: one line when all its cases pass, else what went wrong.

    `shown` holds the TODOs and errors already printed for this stage, so each is printed once.
    """
    cases = f" ({len(items)} cases)" if len(items) > 1 else ""
    bad = [entry for entry in items if entry["kind"] not in ("pass", "skip")]
    if not bad:
        label = "SKIP" if all(entry["kind"] == "skip" for entry in items) else "PASS"
        print(f"  {label:5} {name}{cases}", file=out)
        return
    kinds = {entry["kind"] for entry in bad}
    label = "FAIL" if "fail" in kinds else "ERROR" if "error" in kinds else "TODO"
    if len(bad) < len(items):
        cases = f" ({len(bad)} of {len(items)} cases)"
    print(f"  {label:5} {name}{cases}", file=out)

    todos = [entry for entry in bad if entry["kind"] == "todo"]
    for key in dict.fromkeys((entry.get("function", ""), entry["message"]) for entry in todos):
        function, hint = key
        where = f" in {function}()" if function else ""
        if key in shown:
            print(f"        waiting on the TODO{where} (see above)", file=out)
        else:
            shown.add(key)
            print(f"        TODO not done yet{where}: {hint}", file=out)
    others = [entry for entry in bad if entry["kind"] != "todo"]
    for entry in others[:_MAX_CASES_SHOWN]:
        message = entry.get("message") or "(no message)"
        if entry["kind"] == "error" and ("error", message) in shown:
            print("        the same error as above", file=out)
            continue
        shown.add((entry["kind"], message))
        # A FAIL message names its inputs; an unexpected exception does not, so name the case.
        case = entry["nodeid"].split("::", 1)[1][len(name):]
        if case and entry["kind"] != "fail":
            print(f"        case {case}:", file=out)
        print(_indent(message), file=out)
    if len(others) > _MAX_CASES_SHOWN:
        print(f"        ... and {len(others) - _MAX_CASES_SHOWN} more failing cases", file=out)


_MAX_CASES_SHOWN = 3


def _print_summary(wanted: Sequence[int], entries: list[dict], returncode: int, output: str,
                   directory: Path, answers: dict[int, Path], root: Path, out: TextIO) -> int:
    by_stage: dict[int, list[dict]] = {n: [] for n in wanted}
    harness_errors = []
    for entry in entries:
        match = re.search(r"test_stage(\d+)\.py::", entry.get("nodeid", ""))
        if match and int(match.group(1)) in by_stage:
            by_stage[int(match.group(1))].append(entry)
        else:
            harness_errors.append(entry)

    all_pass = True
    pending = []
    for stage in wanted:
        filename = answers[stage].name if stage in answers else f"stage{stage}_*.py"
        print(f"Stage {stage}: {_display(directory / filename, root)}", file=out)
        results = by_stage[stage]
        counts = {kind: 0 for kind in ("pass", "fail", "todo", "error", "import", "skip")}
        for entry in results:
            entry.setdefault("kind", "error")
            counts[entry["kind"]] = counts.get(entry["kind"], 0) + 1

        imports = list(dict.fromkeys(entry["message"] for entry in results
                                     if entry["kind"] == "import"))
        for message in imports:
            print(f"  CANNOT IMPORT {filename}, so none of its tests ran:", file=out)
            print(_indent(message), file=out)
        groups: dict[str, list[dict]] = {}
        for entry in results:
            if entry["kind"] != "import":
                test = entry["nodeid"].split("::", 1)[1]
                groups.setdefault(test.split("[", 1)[0], []).append(entry)
        shown: set = set()
        for name, items in groups.items():
            _print_group(name, items, shown, out)
        if not results:
            print("  no test reported a result", file=out)

        failed = sum(counts[k] for k in ("fail", "todo", "error", "import"))
        stage_pass = bool(results) and failed == 0
        parts = [f"{counts[k]} {label}" for k, label in
                 (("fail", "failed"), ("todo", "wait on a TODO"), ("error", "raised an error"),
                  ("import", "did not run"), ("skip", "skipped")) if counts[k]]
        detail = f": {', '.join(parts)}" if parts else ""
        print(f"Stage {stage}: {'PASS' if stage_pass else 'NOT YET'} ({counts['pass']} of "
              f"{len(results)} tests pass{detail})\n", file=out)
        all_pass &= stage_pass
        if not stage_pass:
            pending.append(str(stage))

    for entry in harness_errors:
        print(f"kvlab check: {entry.get('nodeid') or 'the test run'} could not be collected:",
              file=out)
        print(_indent(entry.get("message", "")), file=out)
        all_pass = False
    if returncode not in (0, 1) and not harness_errors:
        # pytest itself stopped (usage error, internal error, crash): show the end of its output.
        tail = "\n".join(output.strip().splitlines()[-15:])
        print(f"kvlab check: the test run stopped early (pytest exit code {returncode}):", file=out)
        print(_indent(tail or "(no output)"), file=out)
        all_pass = False
    if returncode != 0:
        all_pass = False  # a failure the report did not see; never claim success

    if all_pass:
        print("All checked stages pass.", file=out)
        return 0
    if pending:
        print(f"Not there yet: stage {', '.join(pending)}. Start with the first FAIL, ERROR or "
              f"TODO above, then run `kvlab check {pending[0]}` again.", file=out)
    return 1
