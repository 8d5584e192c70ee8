"""The exercise system: exercises/ is what solutions/ generates; `kvlab check` grades in one clean
line per test; `kvlab.tools.grading` rejects a float for an int, a wrong dtype and non-finite
values."""

import os
import re
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kvlab.tools.grading import assert_close, assert_equal, expect_raises

ROOT = Path(__file__).resolve().parents[1]
MAKE = runpy.run_path(str(ROOT / "scripts" / "make_exercises.py"))
ZEROS = torch.zeros(2, 3)
STAGES = sorted(int(p.stem[10:]) for p in ROOT.glob("tests/exercises/test_stage*.py"))
# Stage 5's online softmax with exp(score) as it is: right on small scores, NaN on large ones.
NO_RUNNING_MAX = ("alpha = tl.exp(m - m_new)\n    p = tl.exp(scores - m_new[:, None])\n"
                  "    l = l * alpha + tl.sum(p, axis=1)\n    acc = acc * alpha[:, None] +",
                  "p = tl.exp(scores)\n    l = l + tl.sum(p, axis=1)\n    acc = acc +")
MISTAKES = [  # (stage, answer text, the learner's version, the line kvlab check prints)
    (0, "max(0, free_bytes // per_request)", "max(0, free_bytes / per_request // 1)",
     r"FAIL  test_max_concurrent_requests_rounds_down: .*: expected int 3, got float 3\.0$"),
    (1, "return weight * normed.to(x.dtype)", "return weight.double() * normed.double()",
     r"FAIL  test_rms_norm_matches_kvlab \(3 of 3 cases\): .*, got tensor \[5, 16\] float64$"),
    (1, "return torch.cat([out_first, out_second], dim=-1).to(x.dtype)", "return x / 0 * 0",
     r"FAIL  test_apply_rope_any_positions: apply_rope\(.*: 64 of 64 values differ; .* got nan "),
    (2, "import torch\n", "import torch\nfrom torch import\n",
     r"ERROR test_check_reservation_fits: SyntaxError: .* \(stage2_\w+\.py, line \d+\)$"),
    (3, "return h // group", "return h.floordiv(group)", r"ERROR test_kv_head_for_query_head "
     r"\(\d of 8 cases\): AttributeError: .* \(stage3_\w+\.py line \d+: return h\.floordiv"),
    (5, *NO_RUNNING_MAX, r"FAIL  test_online_softmax_large_scores_need_the_running_max: online "
     r"softmax of scores up to \d+ in 3 tiles of 16, .* got nan \(tolerance "),
]
# The online-softmax mistakes that small random scores let through: (the mistake, edits of
# solutions/stage5's answer, {check: the start of its one-line message}).
SOFTMAX_MISTAKES = [
    ("exp(score) without subtracting the running max", [NO_RUNNING_MAX], {
        "test_online_softmax_large_scores_need_the_running_max":
            r"online softmax of scores up to \d+ .* got nan ",
        "test_decode_with_large_scores_matches_float64_sdpa":
            r"paged_decode\(seq_lens=\[70, 23, 1\], .* vs float64 SDPA .* got nan "}),
    ("l and acc not rescaled when the max grows",
     [("l = l * alpha +", "l = l +"), ("acc = acc * alpha[:, None] +", "acc = acc +")], {
        "test_online_softmax_rescales_when_the_max_grows_late":
            r"online softmax over 40 keys whose max grows in tiles 2 and 3 \[when the max grows, "
            r"rescale both l and acc by exp\(old max - new max\)\]: \d+ of 256 values differ",
        "test_decode_with_large_scores_matches_float64_sdpa": r"paged_decode\(.* values differ"}),
    ("the wrong rescale factor, 2^(old max - new max)",
     [("alpha = tl.exp(m - m_new)", "alpha = tl.exp2(m - m_new)")], {
        "test_online_softmax_rescales_when_the_max_grows_late": r"online softmax over 40 keys .* "
                                                                r"values differ"}),
    ("the tile's max instead of max(old max, tile max)",
     [("m_new = tl.maximum(m, tl.max(scores, axis=1))", "m_new = tl.max(scores, axis=1)")], {
        "test_online_softmax_large_scores_need_the_running_max": r"online softmax .* got nan ",
        "test_decode_with_large_scores_matches_float64_sdpa": r"paged_decode\(.* got nan "}),
]


def kvlab_check(*args: str, before: str = "pass", cwd: Path = ROOT) -> tuple[int, str]:
    """`kvlab check ARGS` in a fresh process, as a learner runs it: exit code, all it printed."""
    program = f"import sys; {before}; from kvlab.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", program, "check", *args], capture_output=True,
                         text=True, timeout=600, cwd=cwd)
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
    return run.returncode, run.stdout + run.stderr


def test_exercises_are_generated_from_the_solutions():
    assert STAGES == sorted(int(p.name[5:].split("_")[0]) for p in ROOT.glob("solutions/stage*"))
    yours = subprocess.run(["git", "status", "--porcelain", "exercises"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()[1::2]
    if yours and not os.environ.get("CI"):  # in CI, every difference is drift
        pytest.skip(f"exercises/ holds your uncommitted work: {yours}")
    assert MAKE["main"](["--check"]) == 0


def test_checker_passes_the_solutions_and_fails_untouched_exercises_cleanly(tmp_path):
    code, output = kvlab_check("all", "--target", "solutions")
    assert code == 0 and output.count(": PASS (") == len(STAGES), output
    MAKE["main"](["--out", str(tmp_path)])
    code, output = kvlab_check("all", "--target", str(tmp_path))
    assert code == 1 and all(f"Stage {n}: NOT YET (0 of" in output for n in STAGES), output
    assert all(line.startswith(("Stage ", "  TODO  test_")) for line in output.splitlines())
    assert "  TODO  test_kv_cache_bytes_70b: kv_cache_bytes(): every token of every" in output


def test_checker_reports_each_kind_of_mistake_on_one_line(tmp_path):
    for answer in ROOT.glob("solutions/stage*_*.py"):
        (tmp_path / answer.name).write_text(answer.read_text())
    for stage, answer_text, learner_text, _ in MISTAKES:
        mine = next(tmp_path.glob(f"stage{stage}_*.py"))
        text = mine.read_text()
        assert answer_text in text, f"solutions/{mine.name} changed: update this test"
        mine.write_text(text.replace(answer_text, learner_text, 1))
    code, output = kvlab_check("all", "--target", str(tmp_path))
    for *_, line in MISTAKES:
        assert code == 1 and re.search("^  " + line, output, re.M), f"no {line!r} in:\n{output}"


@pytest.mark.parametrize("mistake, edits, failures", SOFTMAX_MISTAKES,
                         ids=[mistake for mistake, *_ in SOFTMAX_MISTAKES])
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid:RuntimeWarning")
def test_stage5_checks_catch_each_online_softmax_mistake(tmp_path, mistake, edits, failures):
    # The checks called directly, in this process (Triton is imported once): a second or so for
    # all four. The kvlab check line of the first mistake is in MISTAKES above.
    pytest.importorskip("triton")
    mine = tmp_path / "stage5_paged_attention.py"
    text = (ROOT / "solutions" / mine.name).read_text()
    for answer_text, learner_text in edits:
        assert answer_text in text, f"solutions/{mine.name} changed: update {mistake!r}"
        text = text.replace(answer_text, learner_text, 1)
    mine.write_text(text)
    learner = types.SimpleNamespace(**runpy.run_path(str(mine)))
    checks = runpy.run_path(str(ROOT / "tests" / "exercises" / "test_stage5.py"))
    for check, message in failures.items():
        with pytest.raises(AssertionError, match=message):
            checks[check](learner)


@pytest.mark.parametrize("args, before, message", [
    (["99"], "pass", f"kvlab check: error: no stage '99'; stages with tests: {STAGES} or 'all'\n"),
    (["0", "--target", "/no/such/folder"], "pass", "/no/such/folder is not a folder"),
    (["0"], "sys.modules['pytest'] = None", "kvlab check: error: pytest is not installed"),
])
def test_checker_says_in_one_line_why_it_cannot_check(args, before, message):
    code, output = kvlab_check(*args, before=before)
    assert code == 2 and output.count("\n") == 1 and message in output, output


def test_checker_knows_the_file_each_stage_grades():
    """The missing-file line needs each stage's file names: its tests' load_stage("...") calls."""
    from kvlab.tools.checker import exercise_files, stage_tests

    for stage, tests in stage_tests().items():
        files = exercise_files(tests)
        assert files and all(name.startswith(f"stage{stage}_") for name in files), (stage, files)
        assert all((ROOT / folder / name).is_file() for folder in ("solutions", "exercises")
                   for name in files), (stage, files)


def test_checker_names_the_missing_files_in_one_line(tmp_path):
    code, output = kvlab_check("5", "--target", str(tmp_path))
    assert code == 2 and output == (
        f"kvlab check: error: {tmp_path.resolve()} has no stage5_paged_attention.py (the file "
        f"`kvlab check 5` grades); give --target the folder that holds it\n"), output
    (tmp_path / "stage0_kv_size.py").write_text((ROOT / "solutions/stage0_kv_size.py").read_text())
    code, output = kvlab_check("all", "--target", str(tmp_path))
    named = [name for name in re.findall(r"stage\d+_\w+\.py", output)]
    assert code == 2 and output.count("\n") == 1, output
    assert named == sorted(path.name for path in ROOT.glob("solutions/stage*_*.py"))[1:], output


def test_checker_finds_exercises_from_the_current_folder_up(tmp_path):
    """A notebook runs `kvlab check N` from the clone's notebooks/: ../exercises is the one."""
    MAKE["main"](["--out", str(tmp_path / "exercises")])
    (tmp_path / "notebooks").mkdir()
    code, output = kvlab_check("0", cwd=tmp_path / "notebooks")
    assert code == 1 and output.startswith("Stage 0: NOT YET (0 of "), output
    (tmp_path / "exercises" / "stage0_kv_size.py").write_text(
        (ROOT / "solutions" / "stage0_kv_size.py").read_text())
    code, output = kvlab_check("0", cwd=tmp_path / "notebooks")
    assert code == 0 and output.startswith("Stage 0: PASS ("), output


def test_make_exercises_replaces_blocks_and_keeps_learner_edits(tmp_path):
    source = ('def area(w, h):\n    """w x h."""\n    # BEGIN SOLUTION hint: width "times"\n'
              '    # hint: height\n    return w * h\n    # END SOLUTION\n')
    text = MAKE["make_exercise"](source, "stage7_area.py")
    assert text.endswith('"""w x h."""\n    raise NotImplementedError("TODO(stage 7): width '
                         '\\"times\\" height")\n') and "kvlab check 7" in text
    for bad in ("x = 1\n", source.replace("    # END", "# END"), source + "    # END SOLUTION\n"):
        with pytest.raises(ValueError, match="solutions/stage7_area.py"):
            MAKE["make_exercise"](bad, "stage7_area.py")
    out, exercise = ["--out", str(tmp_path)], tmp_path / "stage1_tiny_llama.py"
    MAKE["main"](out)
    edited = exercise.read_text().replace("    raise NotImplementedError", "    return 0  #", 1)
    exercise.write_text(edited)
    assert MAKE["main"](out) == 0 and exercise.read_text() == edited  # the learner's work stays
    assert MAKE["main"]([*out, "--check"]) == 1
    assert MAKE["main"]([*out, "--force"]) == 0 and MAKE["main"]([*out, "--check"]) == 0


@pytest.mark.parametrize("check, got, expected, message", [
    (assert_equal, 3.0, 3, "expected int 3, got float 3.0"),
    (assert_equal, True, 3, "expected int 3, got bool True"),
    (assert_equal, {"a": (3, 4.0)}, {"a": (3, 4)},
     "expected dict {'a': (3, 4)}, got dict {'a': (3, 4.0)}"),
    (assert_close, None, ZEROS, "expected tensor [2, 3] float32, got NoneType None"),
    (assert_close, ZEROS.T, ZEROS, "expected tensor [2, 3] float32, got tensor [3, 2] float32"),
    (assert_close, ZEROS.double(), ZEROS,
     "expected tensor [2, 3] float32, got tensor [2, 3] float64"),
    (assert_close, ZEROS / 0, ZEROS,
     "6 of 6 values differ; worst at [0, 0]: expected 0, got nan (tolerance 1e-06)"),
    (assert_close, torch.tensor([[0, 0, float("inf")]] * 2), ZEROS,
     "2 of 6 values differ; worst at [0, 2]: expected 0, got inf"),
    (assert_close, torch.tensor([[0, 0, 0], [0, 0, 0.5]]), ZEROS,
     "1 of 6 values differ; worst at [1, 2]: expected 0, got 0.5"),
    (expect_raises, ValueError, lambda: 3,
     "expected ValueError to be raised, but it returned int 3"),
    (expect_raises, ValueError, lambda: {}[1],
     "expected ValueError to be raised, but it raised KeyError: 1"),
])
def test_grading_fails_in_one_line(check, got, expected, message):
    with pytest.raises(AssertionError) as failure:
        check(got, expected, "f()")
    assert str(failure.value).startswith(f"f(): {message}")

