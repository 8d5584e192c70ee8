"""Every exercise extends its stage's page rather than copying it: at most a quarter of an answer's
lines (the solution's lines its exercise lacks) appear in the stage's notebooks, comments removed
and local names abstracted (kvlab.tools.exercise_overlap says how, and lists the lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlab.tools.exercise_overlap import (MAX_SHARE, MIN_TOKENS, normalise, overlap,
                                          stage_notebooks)

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted(ROOT.glob("solutions/stage*_*.py"))


def stage_of(path: Path) -> int:
    return int(re.match(r"stage(\d+)_", path.name)[1])


def test_every_stage_has_an_answer_and_a_notebook():
    assert [stage_of(path) for path in SOLUTIONS] == list(range(8))
    for path in SOLUTIONS:
        assert stage_notebooks(ROOT, stage_of(path)), path.name


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda path: path.stem)
def test_at_most_a_quarter_of_the_answer_is_on_the_page(solution):
    found = overlap(stage_of(solution), solution.read_text(), stage_notebooks(ROOT,
                                                                              stage_of(solution)))
    assert found.counted >= 4, f"{solution.name}: an answer of {found.counted} counted lines"
    assert found.share <= MAX_SHARE, (
        f"{solution.name}: {len(found.on_page)} of {found.counted} answer lines are on the page:\n"
        + "\n".join(found.on_page))


def test_names_and_comments_do_not_hide_a_copy():
    page = "scores = torch.where(owned, scores, float('-inf'))  # mask the padding"
    renamed = "s = torch.where(mask, s, float('-inf'))"
    assert normalise(page) == normalise(renamed)
    assert normalise("x = cache.block_size") != normalise("x = cache.num_blocks")  # attributes stay
    assert normalise("f(block_size=4)") != normalise("f(num_blocks=4)")  # keyword arguments stay
    assert len(normalise("return x")) < MIN_TOKENS  # too short to be a copy


def test_a_copied_answer_is_caught(tmp_path):
    answer = ("def f(xs):\n    # BEGIN SOLUTION hint: sum the squares\n    total = 0\n"
              "    for x in xs:\n        total = total + x * x\n    return total * 1\n"
              "    # END SOLUTION\n")
    notebook = tmp_path / "00_page.ipynb"
    notebook.write_text('{"cells": [{"cell_type": "code", "source": '
                        '["acc = 0\\n", "for v in values:\\n", "    acc = acc + v * v\\n"]}]}')
    found = overlap(0, answer, [notebook])
    # `total = 0` and `return total * 1` are too short to count; the other two are on the page
    assert found.counted == 2 and found.on_page == ["for x in xs:", "total = total + x * x"]


def test_a_statement_broken_over_lines_is_one_line(tmp_path):
    answer = ("    # BEGIN SOLUTION\n    blocks = allocate(request, num_new_tokens,  # the step's\n"
              "                      computed, full_sequence_must_fit=True)\n    # END SOLUTION\n")
    notebook = tmp_path / "07_page.ipynb"
    notebook.write_text('{"cells": [{"cell_type": "code", "source": ["got = allocate(r, n, c, '
                        'full_sequence_must_fit=True)\\n"]}]}')
    found = overlap(7, answer, [notebook])
    assert found.on_page == ["blocks = allocate(request, num_new_tokens, computed, "
                             "full_sequence_must_fit=True)"]
