"""The exercise system: exercises/ is what solutions/ generates; `kvlab check` passes the answers,
fails the untouched exercises and broken files one clean line per test; `kvlab.grading` rejects a
float for an int, a wrong dtype and non-finite values (each check pinned here)."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.grading import assert_close, assert_equal, expect_raises

ROOT = Path(__file__).resolve().parents[1]
MAKE = ROOT / "scripts" / "make_exercises.py"
STAGES = sorted(int(p.stem[10:]) for p in ROOT.glob("tests/exercises/test_stage*.py"))


def kvlab_check(*args: str, before: str = "pass") -> tuple[int, str]:
    """`kvlab check ARGS` in a fresh process, as a learner runs it: exit code, all it printed."""
    run = subprocess.run([sys.executable, "-c", f"import sys; {before}; from kvlab.cli import main;"
                          " sys.exit(main(sys.argv[1:]))", "check", *args], capture_output=True,
                         text=True, timeout=600)
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
    return run.returncode, run.stdout + run.stderr


def test_exercises_are_generated_from_the_solutions():
    answers = ROOT.glob("solutions/stage*_*.py")
    assert STAGES == sorted(int(path.name[5:].split("_")[0]) for path in answers)
    stale = subprocess.run([sys.executable, MAKE, "--check"], capture_output=True,
                           text=True).stdout.splitlines()
    if not os.environ.get("CI"):  # a learner's uncommitted work in exercises/ is not drift
        mine = subprocess.run(["git", "status", "--porcelain", "exercises"], cwd=ROOT,
                              capture_output=True, text=True).stdout
        stale = [line for line in stale if Path(line.split()[3]).name not in mine]
    assert not stale


def test_checker_passes_the_solutions_and_fails_untouched_exercises_cleanly(tmp_path):
    code, output = kvlab_check("all", "--target", "solutions")
    assert code == 0 and output.count(": PASS (") == len(STAGES), output
    subprocess.run([sys.executable, MAKE, "--out", tmp_path], check=True, capture_output=True)
    code, output = kvlab_check("all", "--target", str(tmp_path))
    assert code == 1 and output.count(" tests pass)") == len(STAGES), output
    assert all(line.startswith(("Stage ", "  TODO  test_")) for line in output.splitlines())
    assert all(f"Stage {n}: NOT YET (0 of" in output for n in STAGES), output
    assert "  TODO  test_kv_cache_bytes_70b: kv_cache_bytes(): every token of every" in output


def test_checker_reports_each_kind_of_mistake_on_one_line(tmp_path):
    mistakes = {  # stage: [(answer text, the learner's version)]; stage 4: no file at all
        0: [("max(0, free_bytes // per_request)", "max(0, free_bytes / per_request // 1)")],
        1: [("return weight * normed.to(x.dtype)", "return weight.double() * normed.double()"),
            ("return torch.cat([out_first, out_second], dim=-1).to(x.dtype)",
             "return torch.full_like(x, float('nan'))")],
        2: [("import torch\n", "import torch\nfrom torch import\n")],
        3: [("return h // group", "return h.floordiv(group)")],
    }
    for stage, edits in mistakes.items():
        answer = next(ROOT.glob(f"solutions/stage{stage}_*.py"))
        text = answer.read_text()
        for old, new in edits:
            assert old in text, f"{answer.name} lacks {old!r}: update this test"
            text = text.replace(old, new, 1)
        (tmp_path / answer.name).write_text(text)
    code, output = kvlab_check("all", "--target", str(tmp_path))
    assert code == 1, output
    for line in [
        r"FAIL  test_max_concurrent_requests_rounds_down: max_concurrent_requests\(gpu_bytes="
        r"12000.*: expected int 3, got float 3\.0$",
        r"FAIL  test_rms_norm_matches_kvlab \(3 of 3 cases\): rms_norm\(x \[5, 16\] float32.*"
        r"expected dtype torch.float32, got torch.float64",
        r"FAIL  test_apply_rope_any_positions: apply_rope\(.*: 64 non-finite values",
        r"ERROR test_check_reservation_fits: SyntaxError: invalid syntax "
        r"\(stage2_contiguous_cache.py, line \d+\)",
        r"ERROR test_kv_head_for_query_head \(\d of 8 cases\): AttributeError: .*'floordiv'.* "
        r"\(stage3_grouped_query_attention.py line \d+: return h.floordiv\(group\)\)",
        r"ERROR test_slot_mapping_by_hand \(4 of 4 cases\): FileNotFoundError: .*"
        r"stage4_paged_allocator.py'",
    ]:
        assert re.search("^  " + line, output, re.M), f"no line like {line!r} in:\n{output}"


def test_checker_refuses_bad_requests_and_says_when_pytest_is_missing(tmp_path):
    assert kvlab_check("99") == (2, "kvlab check: error: no stage '99'; stages with tests: "
                                    f"{STAGES} or 'all'\n")
    code, output = kvlab_check("0", "--target", str(tmp_path / "missing"))
    assert code == 2 and "is not a folder" in output, output
    code, output = kvlab_check("0", before="sys.modules['pytest'] = None")
    assert code == 2 and "pytest is not installed" in output, output


def test_make_exercises_replaces_blocks_and_keeps_learner_edits(tmp_path):
    make = runpy.run_path(str(MAKE))
    source = ('def area(w, h):\n    """w x h."""\n    # BEGIN SOLUTION hint: width "times"\n'
              '    # hint: height\n    return w * h\n    # END SOLUTION\n')
    text = make["make_exercise"](source, 7, "stage7_area.py")
    assert '\n    raise NotImplementedError("TODO(stage 7): width \\"times\\" height")\n' in text
    assert "w * h" not in text and make["is_untouched"](text)
    for bad in ("x = 1\n", source.replace("    # END", "# END"), source + "    # END SOLUTION\n"):
        with pytest.raises(ValueError, match="solutions/stage7_area.py"):
            make["make_exercise"](bad, 7, "stage7_area.py")
    exercise = tmp_path / "stage1_tiny_llama.py"
    make["main"](["--out", str(tmp_path)])
    edited = exercise.read_text().replace("    raise NotImplementedError", "    return 0  #", 1)
    exercise.write_text(edited)
    assert not make["is_untouched"](edited)
    make["main"](["--out", str(tmp_path)])
    assert exercise.read_text() == edited  # the learner's work stays
    make["main"](["--out", str(tmp_path), "--force"])
    assert exercise.read_text() != edited and make["is_untouched"](exercise.read_text())


@pytest.mark.parametrize("got", [3.0, True, "3", [3]])
def test_assert_equal_is_exact_about_types(got):
    assert_equal({"a": [3, 4]}, {"a": [3, 4]}, "f()")
    with pytest.raises(AssertionError, match=r"^f\(\): expected int 3, got "):
        assert_equal(got, 3, "f()")


@pytest.mark.parametrize("got, message", [
    (None, r"expected tensor \[2, 3\] float32, got NoneType None"),
    (torch.zeros(3, 2), r"expected shape \[2, 3\], got \[3, 2\]"),
    (torch.zeros(2, 3, dtype=torch.float64), "expected dtype torch.float32, got torch.float64"),
    (torch.full((2, 3), float("nan")), r"6 non-finite values; at \[0, 0\] expected 0, got nan"),
    (torch.tensor([[0, 0, float("inf")]] * 2), "2 non-finite values"),
    (torch.tensor([[0, 0, 0], [0, 0, 0.5]]), r"1 of 6 values differ; worst at \[1, 2\]: "
                                              r"expected 0, got 0.5"),
], ids=["not-a-tensor", "shape", "dtype", "nan", "inf", "values"])
def test_assert_close_rejects(got, message):
    assert_close(torch.full((2, 3), 1e-7), torch.zeros(2, 3), "h(x)")
    with pytest.raises(AssertionError, match=r"^h\(x\): " + message):
        assert_close(got, torch.zeros(2, 3), "h(x)")


def test_expect_raises_names_the_wrong_outcome():  # a TODO passes: see the untouched test
    assert isinstance(expect_raises(ValueError, lambda: int("x"), "int('x')"), ValueError)
    with pytest.raises(AssertionError, match="expected ValueError to be raised, but it returned"):
        expect_raises(ValueError, lambda: 3, "three()")
    with pytest.raises(AssertionError, match="expected ValueError, got KeyError"):
        expect_raises(ValueError, lambda: {}[1], "lookup()")
