"""The reading times in the instructor notes and the notebook headers are what the rule gives now.

The rule and the counting live in scripts/reading_times.py; when a notebook's text changes, these
tests fail until `python scripts/reading_times.py --write` is run.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTES = ROOT / "docs" / "instructor_notes.md"
STALE = "stale: run python scripts/reading_times.py --write"


def load_script():
    path = ROOT / "scripts" / "reading_times.py"
    spec = importlib.util.spec_from_file_location("reading_times", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


rt = load_script()
TIMES = rt.all_reading_times()


def table_rows() -> dict[str, re.Match]:
    text = NOTES.read_text(encoding="utf-8")
    return {row["stage"]: row for row in rt.TABLE_ROW.finditer(text)}


def test_the_rule():
    # 300 words = 10 min, 75 code lines = 20 min (calibrated rates: the module docstring).
    assert rt.reading_minutes(300, 75) == 30
    assert rt.reading_minutes(300 + 30 * 2, 75) == 30     # 32 min rounds down
    assert rt.reading_minutes(300 + 15 * 5, 75) == 35     # 32.5 min: halves round up
    assert rt.round_to_five(27.4) == 25 and rt.round_to_five(27.5) == 30
    assert [rt.format_duration(m) for m in (50, 240, 465)] == ["50 min", "4 h", "7 h 45 min"]


def test_counting_words_and_code_lines():
    notebook = {"cells": [
        {"cell_type": "markdown", "source": ["# Stage 9 — a title\n", "\n", "Two  words\n"]},
        {"cell_type": "code", "source": ["x = 1\n", "\n", "   \n", "# a comment counts\n", "y = x"],
         "outputs": [{"output_type": "stream", "text": ["many words that are not counted\n"]}]},
        {"cell_type": "raw", "source": ["not read\n"]},
    ]}
    assert rt.count_notebook(notebook) == (8, 3)  # "#" and "—" are words too


def test_sections_cut_at_level_2_headings_and_add_up_to_the_notebook():
    notebook = {"cells": [
        {"cell_type": "markdown", "source": ["# Title\n", "intro words\n"]},
        {"cell_type": "code", "source": ["x = 1\n"]},
        {"cell_type": "markdown", "source": ["end of intro\n", "## 1. First\n", "three more words"]},
        {"cell_type": "code", "source": ["y = 2\n", "\n", "z = 3"]},
        {"cell_type": "markdown", "source": ["### not a section\n", "## Second"]},
    ]}
    sections = rt.count_sections(notebook)
    assert [(s.heading, s.markdown_words, s.code_lines) for s in sections] == [
        ("(header)", 7, 1), ("1. First", 10, 2), ("Second", 2, 0)]
    assert sections[1].minutes == 10 / 30 + 2 / 3.75  # "### not a section" is in it
    for time in TIMES.values():
        real = json.loads((ROOT / "notebooks" / time.notebook).read_text(encoding="utf-8"))
        cut = rt.count_sections(real)
        assert (sum(s.markdown_words for s in cut), sum(s.code_lines for s in cut)) == (
            time.markdown_words, time.code_lines), time.notebook


def test_every_notebook_has_a_row_and_nothing_in_the_notes_is_stale():
    text = NOTES.read_text(encoding="utf-8")
    assert sorted(table_rows()) == sorted(TIMES), "one table row per notebook"
    assert rt.updated_notes(text, TIMES) == text, f"docs/instructor_notes.md times are {STALE}"


def test_stage_sums_are_in_the_notes():
    text = NOTES.read_text(encoding="utf-8")
    sums = [match for pattern in rt.STAGE_SUMS for match in pattern.finditer(text)]
    assert len(sums) >= 2, "the notes no longer state the time of stages 0–4 and 5–7"


@pytest.mark.parametrize("stage", sorted(TIMES))
def test_notebook_header_states_the_tables_times(stage):
    notebook = json.loads((ROOT / "notebooks" / TIMES[stage].notebook).read_text(encoding="utf-8"))
    header = "".join(notebook["cells"][0]["source"])
    assert rt.header_minutes(notebook) == TIMES[stage].minutes, f"{TIMES[stage].notebook}: {STALE}"
    # A stage's exercise sits in one of its notebooks (its row gives the minutes; the others' rows
    # say ~0 min): a header that gives an exercise time gives the stage's, and the notebook whose
    # row holds the exercise must give it.
    rows = table_rows()
    own = rt.exercise_minutes(rows[stage]["exercise"])
    stage_minutes = max(rt.exercise_minutes(row["exercise"]) for key, row in rows.items()
                        if rt.stage_number(key) == rt.stage_number(stage))
    exercise = re.search(r"plus about (\d+) for the exercise", header)
    assert exercise or not own, f"{TIMES[stage].notebook}: the header gives no exercise time"
    if exercise:
        assert int(exercise.group(1)) == stage_minutes, (
            f"{TIMES[stage].notebook}: the header's exercise time differs from the instructor "
            f"notes'")


def test_rewriting_a_header_changes_one_line_of_the_file(tmp_path):
    source = ROOT / "notebooks" / TIMES["0"].notebook
    notebook = json.loads(source.read_text(encoding="utf-8"))
    assert rt.updated_header(notebook, 95)
    copy = tmp_path / source.name
    rt.write_notebook(copy, notebook)
    before = source.read_text(encoding="utf-8").splitlines()
    after = copy.read_text(encoding="utf-8").splitlines()
    changed = [(old, new) for old, new in zip(before, after) if old != new]
    assert len(before) == len(after) and len(changed) == 1, changed
    assert "about 95 minutes to read and run" in changed[0][1]
    assert copy.read_text(encoding="utf-8").endswith("}\n")


def test_a_stages_second_notebook_is_its_own_row():
    assert (rt.stage_of("04_paged_allocator.ipynb"), rt.stage_of("04b_preemption.ipynb"),
            rt.stage_of("10_next.ipynb")) == ("4", "4b", "10")
    assert rt.stage_number("4b") == 4


def test_a_notebook_without_a_row_is_an_error():
    text = NOTES.read_text(encoding="utf-8")
    extra = dict(TIMES)
    extra["9b"] = rt.ReadingTime(stage="9b", notebook="09b_extra.ipynb", markdown_words=1,
                                 code_lines=1, minutes=0)
    with pytest.raises(ValueError, match=r"no row for stages \['9b'\]"):
        rt.updated_notes(text, extra)
