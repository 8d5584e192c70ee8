"""The exercises system itself: generated learner files, and the checker behind `kvlab check`.

CI guarantees: the files in exercises/ are exactly what solutions/ generates; the checker passes
every stage on the reference answers; on the untouched exercises it fails every stage cleanly
(exit code 1, each test waiting on a TODO, no harness traceback); a broken learner file is
reported, never crashes the checker.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from kvlab.exercises import (ExerciseError, ExerciseImportError, assert_close, assert_equal,
                             check_stage, exercises_up_to_date, expect_raises, find_root,
                             load_exercise, make_exercise, solution_files, stage_numbers,
                             write_exercises)

ROOT = Path(__file__).resolve().parents[1]
STAGES = stage_numbers(ROOT)

# Signs that the harness, not the learner's code, went wrong.
HARNESS_FAILURES = ("Traceback", "INTERNALERROR", "could not be collected", "stopped early",
                    "no test reported a result")


def run_check(stage, target, root=ROOT):
    buffer = io.StringIO()
    code = check_stage(stage, target, root, out=buffer, timeout=300)
    return code, buffer.getvalue()


# ---- the course's own files -------------------------------------------------------------------

def test_every_stage_has_an_answer_and_tests():
    assert STAGES, "no tests/exercises/test_stageN.py found"
    assert list(solution_files(ROOT)) == STAGES, (
        f"stages with answers {list(solution_files(ROOT))} != stages with tests {STAGES}")


def test_exercises_are_up_to_date():
    # In the course's CI the committed exercises must be exactly as generated; on a learner's
    # machine their edited files are their work, not staleness.
    stale = exercises_up_to_date(ROOT, include_edited=bool(os.environ.get("CI")))
    assert not stale, (f"exercises out of date with solutions/: "
                       f"{', '.join(str(p.relative_to(ROOT)) for p in stale)}; run "
                       f"`kvlab exercises --write`")


def test_checker_passes_every_stage_on_the_solutions():
    code, output = run_check("all", "solutions")
    assert code == 0, output
    for stage in STAGES:
        assert re.search(rf"^Stage {stage}: PASS \((\d+) of \1 tests pass\)$", output, re.M), output
    assert not any(sign in output for sign in HARNESS_FAILURES), output


@pytest.fixture(scope="module")
def untouched_check(tmp_path_factory):
    """One checker run over every stage of freshly generated exercises (one pytest subprocess).

    Generated here rather than read from exercises/, so a learner's own edits there do not matter.
    """
    folder = tmp_path_factory.mktemp("untouched")
    for stage, source in solution_files(ROOT).items():
        text = make_exercise(source.read_text(encoding="utf-8"), stage, source.name)
        (folder / source.name).write_text(text, encoding="utf-8")
    return run_check("all", folder)


def test_checker_exit_code_on_the_untouched_exercises(untouched_check):
    code, output = untouched_check
    assert code == 1, output
    assert not any(sign in output for sign in HARNESS_FAILURES + ("CANNOT IMPORT",)), output


@pytest.mark.parametrize("stage", STAGES)
def test_checker_fails_cleanly_on_the_untouched_exercises(untouched_check, stage):
    _, output = untouched_check
    # Every test of an untouched exercise waits on a TODO: none passes by accident, none errors.
    assert re.search(rf"^Stage {stage}: NOT YET \(0 of (\d+) tests pass: \1 wait on a TODO\)$",
                     output, re.M), output
    section = output.split(f"Stage {stage}: ", 1)[1].split(f"Stage {stage}: NOT YET")[0]
    assert "TODO not done yet in " in section, output


def test_checker_reports_broken_learner_files(tmp_path):
    files = solution_files(ROOT)
    for path in files.values():
        shutil.copy(path, tmp_path / path.name)
    # Stage 0: a syntax error. Stage 1: a crash inside rms_norm. Stage 2: a wrong answer.
    broken = {
        0: ("return 2 * num_hidden_layers", "return 2 * num_hidden_layers +"),
        1: ("x32 = x.float()\n", "x32 = x.floaty()\n"),
        2: ("return sum(seq_lens) * bytes_per_token", "return sum(seq_lens)"),
    }
    for stage, (old, new) in broken.items():
        path = tmp_path / files[stage].name
        text = path.read_text()
        assert old in text, f"{path.name} no longer contains {old!r}; update this test"
        path.write_text(text.replace(old, new, 1))

    code, output = run_check("all", tmp_path)
    assert code == 1, output
    assert "CANNOT IMPORT stage0_kv_size.py" in output and "SyntaxError" in output, output
    assert "AttributeError" in output and "stage1_tiny_llama.py line" in output, output
    assert re.search(r"FAIL  test_used_bytes.*\n.*used_bytes\(seq_lens=.*expected .*, got ",
                     output), output
    assert not any(sign in output for sign in HARNESS_FAILURES), output


def test_checker_refuses_bad_requests(tmp_path):
    code, output = run_check(99, "exercises")
    assert code == 2 and "no stage 99" in output, output
    code, output = run_check(0, tmp_path / "missing")
    assert code == 2 and "is not a folder" in output, output
    code, output = run_check(0, "exercises", root=tmp_path)  # a folder with no stage tests
    assert code == 2 and "no stage tests" in output, output


def test_find_root_walks_up(tmp_path, monkeypatch):
    assert find_root(ROOT / "src" / "kvlab") == ROOT
    monkeypatch.chdir(ROOT / "tests")
    assert find_root() == ROOT
    with pytest.raises(ExerciseError, match="no kvlab course folder"):
        find_root(tmp_path)


# ---- the generator ----------------------------------------------------------------------------

SOURCE = textwrap.dedent('''\
    """A module."""


    def area(w, h):
        """w x h."""
        # BEGIN SOLUTION hint: width "times" height
        # hint: (both in metres)
        result = w * h
        return result
        # END SOLUTION


    class Box:
        def volume(self):
            # BEGIN SOLUTION
            return 1
            # END SOLUTION
    ''')


def test_make_exercise_replaces_blocks_keeping_indentation():
    text = make_exercise(SOURCE, 7, "stage7_area.py")
    assert text.startswith("# Stage 7 exercise, GENERATED from solutions/stage7_area.py")
    assert "w * h" not in text and "return 1" not in text and "SOLUTION" not in text
    assert "    raise NotImplementedError('TODO(stage 7): width \"times\" height (both in " \
           "metres)')" in text
    assert '\n        raise NotImplementedError("TODO(stage 7): implement this")\n' in text
    namespace: dict = {}
    exec(compile(text, "stage7_area.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^TODO\(stage 7\): width"):
        namespace["area"](2, 3)
    assert namespace["area"].__doc__ == "w x h."


@pytest.mark.parametrize("source, message", [
    ("x = 1\n", "no '# BEGIN SOLUTION' blocks"),
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n", "never closed"),
    ("def f():\n    return 1\n    # END SOLUTION\n", "without a '# BEGIN SOLUTION'"),
    ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n",
     "do not nest"),
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n# END SOLUTION\n", "not indented like"),
    ("def f():\n    # BEGIN SOLUTION hints are here\n    return 1\n    # END SOLUTION\n",
     "hint: <text>"),
])
def test_make_exercise_rejects_bad_markers(source, message):
    with pytest.raises(ExerciseError, match=re.escape(message)):
        make_exercise(source, 0, "stage0_x.py")


def course_copy(tmp_path: Path) -> Path:
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "solutions" / "stage7_area.py").write_text(SOURCE)
    return tmp_path


def test_write_exercises_keeps_learner_edits(tmp_path):
    root = course_copy(tmp_path)
    target = root / "exercises" / "stage7_area.py"
    assert exercises_up_to_date(root) == [target]
    assert write_exercises(root).written == [target]
    assert exercises_up_to_date(root) == []
    assert write_exercises(root).unchanged == [target]

    # The answer changes: an untouched generated file is simply regenerated.
    (root / "solutions" / "stage7_area.py").write_text(SOURCE.replace("metres", "cm"))
    assert exercises_up_to_date(root) == [target]
    assert write_exercises(root).written == [target]
    assert "cm)" in target.read_text()

    # The learner edits it: never overwritten, unless forced.
    edited = target.read_text().replace("raise NotImplementedError('TODO(stage 7): width",
                                        "return w * h  # raise NotImplementedError('width", 1)
    target.write_text(edited)
    report = write_exercises(root)
    assert report.kept_edited == [target] and target.read_text() == edited
    assert "--force" in report.summary()
    assert write_exercises(root, force=True).written == [target]
    assert exercises_up_to_date(root) == []

    # An exercise whose answer was removed is stale too.
    orphan = root / "exercises" / "stage8_gone.py"
    orphan.write_text("x = 1\n")
    assert exercises_up_to_date(root) == [orphan]


# ---- loading and the assertion helpers --------------------------------------------------------

def test_load_exercise_reports_problems(tmp_path):
    with pytest.raises(ExerciseImportError, match="there is no file"):
        load_exercise("stage0_nothing.py", tmp_path)
    (tmp_path / "stage0_bad.py").write_text("def f(:\n    pass\n")
    with pytest.raises(ExerciseImportError, match=r"stage0_bad.py line 1: SyntaxError"):
        load_exercise("stage0_bad.py", tmp_path)
    (tmp_path / "stage0_raises.py").write_text("x = 1\ny = x / 0\n")
    with pytest.raises(ExerciseImportError, match=r"ZeroDivisionError.*line 2"):
        load_exercise("stage0_raises.py", tmp_path)
    (tmp_path / "stage0_good.py").write_text("import dataclasses\n@dataclasses.dataclass\n"
                                             "class A:\n    x: int = 1\n")
    module = load_exercise("stage0_good.py", tmp_path)
    assert module.A().x == 1 and load_exercise("stage0_good.py", tmp_path) is module


def test_assertion_helpers_say_what_and_where():
    with pytest.raises(AssertionError, match=r"^f\(1\): expected 327,680, got 163,840$"):
        assert_equal(163_840, 327_680, "f(1)")
    with pytest.raises(AssertionError, match="a bool"):
        assert_equal(True, 1, "g()")
    expected = torch.zeros(2, 3)
    got = expected.clone()
    got[1, 2] = 0.5
    with pytest.raises(AssertionError, match=r"1 of 6 values differ; worst at \[1, 2\]: "
                                             r"expected 0, got 0.5"):
        assert_close(got, expected, "h(x)")
    with pytest.raises(AssertionError, match=r"expected shape \[2, 3\], got \[3, 2\]"):
        assert_close(got.T, expected, "h(x)")
    with pytest.raises(AssertionError, match="expected tensor"):
        assert_close(None, expected, "h(x)")

    def todo():
        raise NotImplementedError("TODO(stage 0): later")

    with pytest.raises(NotImplementedError, match="TODO"):
        expect_raises(ValueError, todo, "todo()")
    with pytest.raises(AssertionError, match="expected ValueError to be raised, but it returned 3"):
        expect_raises(ValueError, lambda: 3, "three()")
    assert isinstance(expect_raises(ValueError, lambda: int("x"), "int('x')"), ValueError)
