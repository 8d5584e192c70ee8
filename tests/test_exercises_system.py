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
# Stage 5's split-KV combine weighing each split by exp(m) as it is: right on small scores, NaN
# on large ones.
NO_LARGEST_MAX = ("weights = tl.exp(m - tl.max(m, axis=0))", "weights = tl.exp(m)")
# Stage 5's combine adding the splits' sums as they are, each under its own max: a plausible
# wrong answer that runs, and gives numbers, wrong ones.
SUMS_AS_THEY_ARE = ("tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * l, axis=0)",
                    "tl.sum(acc, axis=0) / tl.sum(l, axis=0)")
MISTAKES = [  # (stage, answer text, the learner's version, the line kvlab check prints)
    (0, "return num_hidden_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes",
     "return 2 * num_hidden_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes",
     r"FAIL  test_mla_published_configs \(4 of 4 cases\): mla_kv_bytes_per_token\(num_hidden_layers="
     r"60, kv_lora_rank=512, qk_rope_head_dim=64, dtype_bytes=2\) .*: expected int 69,120, got int "
     r"138,240 -- twice the answer: MLA caches no separate K and V; one latent rebuilds both$"),
    (1, "return by_pair.transpose(1, 2).reshape(weight.shape)",
     "return by_pair.transpose(1, 2).reshape(weight.shape).double()",
     r"FAIL  test_permute_to_halves_matches_kvlab_gguf_loader \(3 of 3 cases\): permute_to_halves\("
     r"weight \[32, 20\] float32, num_heads=4\) .*: expected tensor \[32, 20\] float32, got tensor "
     r"\[32, 20\] float64$"),
    (1, "return turned.flatten(-2).to(x.dtype)", "return x / 0 * 0",
     r"FAIL  test_rope_interleaved_matches_complex_float64 \(3 of 3 cases\): rope_interleaved\(x "
     r"\[6, 3, 16\] float64, .*: 288 of 288 values differ; .* got nan "),
    (2, "from typing import Protocol, Sequence\n",
     "from typing import Protocol, Sequence\nfrom torch import\n",
     r"ERROR test_reservation_tokens_paper_example \(3 of 3 cases\): SyntaxError: .* "
     r"\(stage2_\w+\.py, line \d+\)$"),
    (4, "            self.ref_counts[block_id] += 1\n", "            self.ref_counts[block_id] = 2\n",
     r"FAIL  test_a_fork_of_a_fork_counts_every_table: ForkingKVCacheManager\(10, block_size=4\), "
     r"allocate_slots\('a', 6\), fork\('a', 'b'\), fork\('b', 'c'\): ref_counts \(three tables list "
     r"blocks 0 and 1; each fork adds one to the count, whatever it was\): expected list \[3, 3, 0"),
    (5, *NO_LARGEST_MAX, r"FAIL  test_combine_splits_of_large_scores_needs_the_largest_max: "
     r"combine_splits of 3 splits whose maxima reach \d+ .* got nan \(tolerance "),
]
# The split-KV mistakes (scripts/common_mistakes.py, stage 5), each with the checks it must fail:
# (the mistake, edits of solutions/stage5's answer, {check, or (check, *its case; a list as a
# tuple): the start of its one-line message}). Most of them run and give numbers, wrong ones.
SPLIT_KV_MISTAKES = [
    ("the split length rounded down",
     [("split_len = -(-int(seq_lens.max()) // num_splits)",
       "split_len = int(seq_lens.max()) // num_splits")], {
        ("test_partials_split_by_split", (40, 17, 1), 8, 2, 4, 3):
            r"paged_decode_partials\(seq_lens=\[40, 17, 1\], .*: split s holds 14 positions from "
            r"s \* 14; m \[24, 3\] vs float64, .* values differ; .* got \d",
        ("test_split_decode_matches_float64_attention", (1, 16, 17, 40), 8, 2, 4, 3):
            r"paged_decode_split\(seq_lens=\[1, 16, 17, 40\], .* values differ"}),
    ("the grid without its third axis",
     [("grid = (num_seqs, num_kv_heads, num_splits)", "grid = (num_seqs, num_kv_heads)")], {
        ("test_partials_split_by_split", (33, 2), 16, 2, 1, 4):
            r"paged_decode_partials\(seq_lens=\[33, 2\], .* \(nan: no program stored there\): .* "
            r"got nan "}),
    ("the split left out of the partials' index",
     [("part = q_rows * num_splits + split", "part = q_rows * num_splits")], {
        ("test_partials_split_by_split", (40, 17, 1), 8, 2, 4, 3):
            r"paged_decode_partials\(seq_lens=\[40, 17, 1\], .* values differ"}),
    ("padding lanes loaded as m = 0",
     [('m = tl.load(m_ptr + parts, mask=real, other=float("-inf"))',
       "m = tl.load(m_ptr + parts, mask=real, other=0.0)")], {
        "test_combine_loads_each_rows_splits":
            r"combine\(m, l, acc\) of 5 rows x 3 splits .* load it as an empty split, m = -inf, "
            r"l = 0, acc = 0\]: \d+ of 80 values differ; .* got nan "}),
    ("a split's end not clipped to seq_len",
     [("return start, tl.minimum(start + split_len, seq_len)", "return start, start + split_len")], {
        ("test_split_range_by_hand", 40, 16, 3):
            r"split_range\(seq_len=40, split=s, split_len=16\) for s = 0\.\.2, split 2 .* "
            r"expected tuple \(32, 40\), got tuple \(32, 48\)",
        ("test_split_decode_matches_float64_attention", (1, 16, 17, 40), 8, 2, 4, 3):
            r"paged_decode_split\(seq_lens=\[1, 16, 17, 40\], .* got nan "}),
    ("every split runs to the sequence's end",
     [("return start, tl.minimum(start + split_len, seq_len)", "return start, seq_len")], {
        ("test_split_range_by_hand", 48, 16, 3):
            r"split_range\(.*, split 0 .* expected tuple \(0, 16\), got tuple \(0, 48\)",
        ("test_split_decode_matches_float64_attention", (33, 2), 16, 2, 1, 4):
            r"paged_decode_split\(seq_lens=\[33, 2\], .* values differ; .* got \d"}),
    ("exp(m) without subtracting the largest m", [NO_LARGEST_MAX], {
        "test_combine_splits_of_large_scores_needs_the_largest_max":
            r"combine_splits of 3 splits whose maxima reach \d+ .* got nan ",
        "test_split_decode_with_large_scores_matches_float64_attention":
            r"paged_decode_split\(seq_lens=\[70, 23, 1\], .* vs float64 SDPA .* got nan "}),
    ("the splits' sums added as they are, each under its own max", [SUMS_AS_THEY_ARE], {
        "test_combine_splits_equals_softmax":
            r"combine_splits of 3 splits .* \[each split's l and acc are sums under its own max: "
            r"scale both by exp\(m_split - common max\) before adding them up\]: \d+ of 64 values "
            r"differ; worst at \[\d+, \d+\]: expected -?\d\S*, got -?\d",
        "test_split_decode_with_large_scores_matches_float64_attention":
            r"paged_decode_split\(.* values differ"}),
    ("acc weighted, l not", [("tl.sum(weights * l, axis=0)", "tl.sum(l, axis=0)")], {
        "test_combine_splits_equals_softmax": r"combine_splits of 3 splits .* values differ"}),
    ("each split's acc / l weighted by exp(m - max) alone",
     [("tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * l, axis=0)",
       "tl.sum(weights[:, None] * acc / l[:, None], axis=0) / tl.sum(weights, axis=0)")], {
        "test_combine_splits_equals_softmax": r"combine_splits of 3 splits .* values differ",
        "test_combine_splits_with_empty_splits":
            r"combine_splits of 4 splits of which the last 2 are empty .* got nan "}),
    ("weighted by 2^(m - max) instead of e^(m - max)",
     [("weights = tl.exp(m - tl.max(m, axis=0))", "weights = tl.exp2(m - tl.max(m, axis=0))")], {
        "test_combine_splits_equals_softmax": r"combine_splits of 3 splits .* values differ"}),
    # Triton's CPU interpreter stores and loads real memory: the partials sit inside NaN margins
    # (nan_partials), so a stray store is found there, and a stray read brings in NaN.
    ("the partials stored without the padding-row mask",
     [("tl.store(m_ptr + part, m, mask=real_row)", "tl.store(m_ptr + part, m)"),
      ("tl.store(l_ptr + part, l, mask=real_row)", "tl.store(l_ptr + part, l)"),
      ("acc, mask=real_row[:, None])", "acc)")], {
        ("test_partials_split_by_split", (40, 17, 1), 8, 2, 4, 3):
            r"paged_decode_partials\(seq_lens=\[40, 17, 1\], .* m: your kernel wrote outside the "
            r"partials, 12 row\(s\) past their last \(of 24 rows\): mask the group's padding rows$",
        ("test_partials_split_by_split", (33, 2), 16, 2, 1, 4):
            r"m: your kernel wrote outside the partials, 15 row\(s\) past their last \(of 4 rows\)"}),
    ("acc loaded without the mask in the combine",
     [("acc = tl.load(acc_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :], mask=real[:, None],\n"
       "                  other=0.0)", "acc = tl.load(acc_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :])")], {
        "test_combine_loads_each_rows_splits":
            r"combine\(m, l, acc\) of 5 rows x 3 splits .* mask its loads of m, l and acc .*: 16 of "
            r"80 values differ; worst at \[4, \d+\]: expected -?\d\S*, got nan "}),
]


# One plausible wrong answer per stage that *runs* and gives numbers, wrong ones (not a crash): the
# grader must fail it with a line that says what is wrong. A tolerance loosened until a wrong
# figure passes (stage 3's, once, at 1e9) fails this test. (stage: answer text, the learner's
# version, the line kvlab check prints)
WRONG_ANSWERS = {
    0: ("return 2 * num_hidden_layers * heads * head_dim * dtype_bytes",
        "return 2 * num_hidden_layers * num_key_value_heads * head_dim * dtype_bytes // tp",
        r"FAIL  test_kv_bytes_per_gpu_by_hand \(2 of 5 cases\): kv_bytes_per_token_per_gpu\("
        r"num_hidden_layers=80, num_key_value_heads=8, head_dim=128, dtype_bytes=2, tp=16\) .*: "
        r"expected int 40,960, got int 20,480 -- your figure is the whole model's divided by tp"),
    1: ("even * cos - odd * sin, odd * cos + even * sin",
        "even * cos + odd * sin, odd * cos - even * sin",
        r"FAIL  test_rope_interleaved_matches_complex_float64 \(3 of 3 cases\): rope_interleaved\("
        r"x \[6, 3, 16\] float64, .* values differ; worst at .* -- your output turns each pair the "
        r"other way \(by -angle\); RoPE's is out\[2j\] = .*$"),
    2: ("output_slots = 1 << (output_len - 1).bit_length() if output_len > 0 else 0\n"
        "    return min(prompt_len + output_slots, max_model_len)",
        "return min(1 << (prompt_len + output_len - 1).bit_length(), max_model_len)",
        r"FAIL  test_reservation_tokens_paper_example \(1 of 3 cases\): reservation_tokens\("
        r"prompt_len=100, output_len=25, policy='pow2', max_model_len=2048\): expected int 132, "
        r"got int 128"),
    3: ("per_kv_head, k_cache) / math.sqrt(head_dim)", "per_kv_head, k_cache)",
        r"FAIL  test_decode_attention_matches_sdpa_float64 \(4 of 5 cases\): decode_attention\("
        r"query \[3, 4, 8\] float64, .* \d+ of 96 values differ; worst at .* -- your output is "
        r"attention without the 1/sqrt\(head_dim\) scale on the scores$"),
    4: ("held % self.block_size != 0", "held > 0",
        r"FAIL  test_a_full_shared_block_is_never_copied: ForkingKVCacheManager\(10, "
        r"block_size=4\), allocate_slots\('a', 8\), fork\('a', 'b'\), allocate_slots\('b', 1\): "
        r"the blocks taken .*: expected list of 1 \[2\], got list of 2 \[2, 3\]"),
    5: (*SUMS_AS_THEY_ARE,
        r"FAIL  test_combine_splits_equals_softmax: combine_splits of 3 splits .* values differ"),
    6: ("matched += shared", "matched += len(run)",
        r"FAIL  test_match_by_hand \(1 of 8 cases\): match\(tree of .*, \[1, 2, 7, 8, 0, 0\]\): "
        r"expected int 4, got int 5$"),
    7: ("budget += scheduled.pop(victim, 0)", "scheduled.pop(victim, 0)",
        r"FAIL  test_one_step_decides_like_vllm_priority \(1 of 11 cases\): scenario 'the victim "
        r"already ran this step: its tokens go back' .*: first difference at \['scheduled \(id, "
        r"tokens\)'\]\[1\]\[1\]: expected int 2, got int 1$"),
}


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
    assert ("  TODO  test_sliding_window_mistral_paper: sliding_window_kv_bytes(): point 2 of the "
            "module docstring says what a layer keeps") in output


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


def test_every_grader_fails_a_plausible_wrong_answer_that_runs(tmp_path):
    """Each stage's wrong answer runs to the end and gives numbers; its grader says FAIL (a wrong
    value), not ERROR (a crash), on the check that names what is wrong."""
    assert sorted(WRONG_ANSWERS) == STAGES, "one plausible wrong answer per stage"
    for answer in ROOT.glob("solutions/stage*_*.py"):
        (tmp_path / answer.name).write_text(answer.read_text())
    for stage, (answer_text, learner_text, _) in WRONG_ANSWERS.items():
        mine = next(tmp_path.glob(f"stage{stage}_*.py"))
        text = mine.read_text()
        assert answer_text in text, f"solutions/{mine.name} changed: update WRONG_ANSWERS"
        mine.write_text(text.replace(answer_text, learner_text, 1))
    code, output = kvlab_check("all", "--target", str(tmp_path))
    assert code == 1 and "  ERROR " not in output, output
    for stage, (*_, line) in WRONG_ANSWERS.items():
        assert re.search("^  " + line, output, re.M), f"stage {stage}: no {line!r} in:\n{output}"


@pytest.mark.parametrize("mistake, edits, failures", SPLIT_KV_MISTAKES,
                         ids=[mistake for mistake, *_ in SPLIT_KV_MISTAKES])
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid:RuntimeWarning")
def test_stage5_checks_catch_each_split_kv_mistake(tmp_path, mistake, edits, failures):
    # The checks called directly, in this process (Triton is imported once): a few seconds for
    # all of them. The kvlab check line of the no-largest-max mistake is in MISTAKES above.
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
        name, *case = (check,) if isinstance(check, str) else check
        with pytest.raises(AssertionError, match=message):
            checks[name](learner, *(list(a) if isinstance(a, tuple) else a for a in case))


def test_stage5_checker_turns_a_crash_into_one_fail_line(tmp_path):
    # A kernel's stray store can kill Python in Triton's CPU interpreter ("Fatal Python error:
    # Aborted"): kvlab check runs the tests in a child process, FAILs the test it was running in
    # one line, and runs the rest in a new child. Here the learner's code aborts in one case.
    pytest.importorskip("triton")
    for answer in ROOT.glob("solutions/stage*_*.py"):
        (tmp_path / answer.name).write_text(answer.read_text())
    mine = tmp_path / "stage5_paged_attention.py"
    text = mine.read_text()
    launch = "    launch(paged_decode_split_kernel, grid,"
    assert launch in text, "solutions/stage5_paged_attention.py changed: update this test"
    mine.write_text(text.replace(launch, "    if num_splits == 4:\n        import os\n        os.abort()\n"
                                 + launch, 1))
    code, output = kvlab_check("5", "--target", str(tmp_path))
    assert code == 1 and output.startswith("Stage 5: NOT YET (13 of 15 tests pass)\n"), output
    assert re.search(r"^  FAIL  test_partials_split_by_split \(1 of 2 cases\): Python crashed "
                     r"running this check \(Fatal Python error: Aborted\): a load or store outside "
                     r"its tensor\? .* mask every lane that is not yours$", output, re.M), output
    assert len(output.splitlines()) == 3, output


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

