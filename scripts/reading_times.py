"""How long each notebook takes a first-time learner, counted from the committed notebooks.

The rule (docs/instructor_notes.md, "Time per stage: run times measured, reading times counted"):

    minutes = markdown words / 30 words per minute
            + non-blank code lines / 3.75 lines per minute,   rounded to the nearest 5 minutes

* a *word* is a whitespace-separated token of a markdown cell's source (headings, list bullets and
  formulas count as they are written; outputs never count);
* a *code line* is a line of a code cell's source holding anything other than whitespace.

The rates are not silent reading (120 words and 15 code lines a minute, this rule until 7 December
2026, which gave a third of the time learners took): they are calibrated to what a first-time
learner spends per word and per line with everything else a notebook asks — running the cells,
reading outputs, tables and plots, tracing an example by hand, thinking. On 7 December 2026 fresh
reviewers, one per notebook or pair of notebooks and none twice, each took notebooks as a
first-time learner would (running them, reading every output, trying the exercise) and estimated a
human first-time learner's time section by section, over six rounds of revision: 62 estimates of
the twelve notebooks. Set against the words and code lines of the version each reviewer read,
they averaged 1.48 times (median 1.46) the rule of 60 words and 7.5 code lines a minute that a
first round of ten had given, which became 40 words and 5 lines. After the notebooks were cut to
45 minutes by that rule, a seventh round (seven reviewers, 7 December 2026, at commit 64b51a4)
estimated the thirteen notebooks at 50-80 minutes: 1.12-1.80 times the rule's count, median 1.35,
mean 1.40. These rates are 40 and 5 divided by 1.33 (the rule within -26 % ... +19 % of each of those
estimates: reviewers differ more than the notebooks do; 07b, the densest, drew the longest). The
estimates are the reviewers' own, not a stopwatch on a human reader.

Halves round up (22.5 minutes reads as 25), so a figure does not flip with Python's round-half-even.

    python scripts/reading_times.py              # print the table
    python scripts/reading_times.py --sections   # and each notebook's "## " sections, unrounded
    python scripts/reading_times.py --write      # rewrite the figures in the notes and headers

A *section* starts at a markdown line beginning with "## " and runs to the next one (what comes
before the first is the header); the instructor notes' 3-hour plan is built from these minutes.

`--write` rewrites three things and nothing else:

* the *reading* and *total* cells of the instructor notes' table (total = reading + the exercise
  minutes already written in the row's exercise cell, "~N min");
* the sums of totals in the sentences below the table ("Stages 0–4 add up to 7 h 45 min",
  "Stages 5–7 (4 h 20 min)");
* the "about N minutes to read and run" in each notebook's first (markdown) cell. Only that line of
  the .ipynb file changes: the notebook is loaded and saved as JSON the way Jupyter stores it
  (one-space indent, non-ASCII kept, trailing newline), and it is not re-executed. Changing the
  number in the header does not change the word count, so the figures are stable.

tests/test_reading_times.py recomputes everything and fails when a figure is stale.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
INSTRUCTOR_NOTES = ROOT / "docs" / "instructor_notes.md"

WORDS_PER_MINUTE = 30
CODE_LINES_PER_MINUTE = 3.75
ROUND_TO_MINUTES = 5

# "**Time:** about 25 minutes to read and run, plus about 30 for the exercise."
HEADER_TIME = re.compile(r"(\*\*Time:\*\* about )(\d+)( minutes to read and run)")
# A row of the table: "| 4 paged allocator | 22 s | 55 min (3,335 words, 441 lines) | ... |"
TABLE_ROW = re.compile(r"^\| (?P<stage>\d+[a-z]?) (?P<name>[^|]+?) \| (?P<run>[^|]+) "
                       r"\| (?P<reading>[^|]+) \| (?P<exercise>[^|]+) \| (?P<total>[^|]+) \|$",
                       re.M)
EXERCISE_MINUTES = re.compile(r"~(\d+) min")
# A duration in the prose: "7 h 45 min", "4 h", or "50 min".
DURATION = r"(?:\d+ h \d+ min|\d+ h|\d+ min)"
STAGE_SUMS = [re.compile(r"(Stages (\d+)–(\d+) add up to )(" + DURATION + ")"),
              re.compile(r"(Stages (\d+)–(\d+) \()(" + DURATION + r")(\))")]


@dataclass(frozen=True)
class ReadingTime:
    """What a learner reads in one notebook, and the minutes the rule gives for it."""

    stage: str              # "4", or "4b" for a stage's second notebook (04b_*.ipynb)
    notebook: str           # file name, e.g. "04_paged_allocator.ipynb"
    markdown_words: int     # whitespace-separated tokens of all markdown cells
    code_lines: int         # non-blank lines of all code cells
    minutes: int            # rounded to ROUND_TO_MINUTES

    @property
    def reading_cell(self) -> str:
        """The table's reading cell, e.g. "55 min (3,335 words, 441 lines)"."""
        return f"{self.minutes} min ({self.markdown_words:,} words, {self.code_lines:,} lines)"


def round_to_five(minutes: float) -> int:
    """Round minutes to the nearest multiple of ROUND_TO_MINUTES, halves up (22.5 -> 25)."""
    return ROUND_TO_MINUTES * math.floor(minutes / ROUND_TO_MINUTES + 0.5)


def count_notebook(notebook: dict) -> tuple[int, int]:
    """(markdown words, non-blank code lines) of a notebook loaded from its JSON."""
    words = code_lines = 0
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(source.split())
        elif cell["cell_type"] == "code":
            code_lines += sum(1 for line in source.splitlines() if line.strip())
    return words, code_lines


@dataclass(frozen=True)
class SectionTime:
    """What a learner reads in one "## " section of a notebook (the header: before the first)."""

    heading: str
    markdown_words: int
    code_lines: int

    @property
    def minutes(self) -> float:
        """Unrounded: a plan adds several sections before it rounds."""
        return self.markdown_words / WORDS_PER_MINUTE + self.code_lines / CODE_LINES_PER_MINUTE


def count_sections(notebook: dict) -> list[SectionTime]:
    """The notebook cut at its "## " headings; the counts add up to `count_notebook`'s."""
    sections = [["(header)", 0, 0]]
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            for line in source.splitlines():  # a heading may start in the middle of a cell
                if line.startswith("## "):
                    sections.append([line[3:].strip(), 0, 0])
                sections[-1][1] += len(line.split())
        elif cell["cell_type"] == "code":
            sections[-1][2] += sum(1 for line in source.splitlines() if line.strip())
    return [SectionTime(heading, words, lines) for heading, words, lines in sections]


def reading_minutes(words: int, code_lines: int) -> int:
    """Minutes to read `words` of markdown and `code_lines` of code, rounded to 5 minutes."""
    return round_to_five(words / WORDS_PER_MINUTE + code_lines / CODE_LINES_PER_MINUTE)


def stage_of(name: str) -> str:
    """The stage a notebook's file name starts with: "04_..." -> "4", "04b_..." -> "4b"."""
    prefix = name.split("_", 1)[0]
    return str(int(prefix.rstrip("abcdefghijklmnopqrstuvwxyz"))) + prefix.lstrip("0123456789")


def stage_number(stage: str) -> int:
    """"4b" -> 4."""
    return int(stage.rstrip("abcdefghijklmnopqrstuvwxyz"))


def reading_time(path: Path) -> ReadingTime:
    """Count one notebook; its stage comes from its file name (`stage_of`)."""
    words, code_lines = count_notebook(json.loads(path.read_text(encoding="utf-8")))
    return ReadingTime(stage=stage_of(path.name), notebook=path.name,
                       markdown_words=words, code_lines=code_lines,
                       minutes=reading_minutes(words, code_lines))


def all_reading_times(notebooks: Path = NOTEBOOKS) -> dict[str, ReadingTime]:
    """Every notebook's reading time, keyed by stage ("4", "4b"), in file order."""
    times = [reading_time(path) for path in sorted(notebooks.glob("[0-9]*.ipynb"))]
    return {time.stage: time for time in times}


def format_duration(minutes: int) -> str:
    """465 -> "7 h 45 min", 240 -> "4 h", 50 -> "50 min"."""
    hours, rest = divmod(minutes, 60)
    if not hours:
        return f"{rest} min"
    return f"{hours} h {rest} min" if rest else f"{hours} h"


def exercise_minutes(exercise_cell: str) -> int:
    """The "~N min" of a table's exercise cell; ValueError if the cell has none."""
    found = EXERCISE_MINUTES.search(exercise_cell)
    if not found:
        raise ValueError(f"exercise cell {exercise_cell!r} has no '~N min' estimate")
    return int(found.group(1))


def updated_notes(text: str, times: dict[str, ReadingTime]) -> str:
    """The instructor notes with the table's reading and total cells and the stage sums recomputed.

    Raises ValueError when a table row names a stage without a notebook, or a notebook has no row.
    """
    totals: dict[str, int] = {}

    def row(match: re.Match) -> str:
        stage = match["stage"]
        if stage not in times:
            raise ValueError(f"the table has a row for stage {stage}, which has no notebook")
        totals[stage] = times[stage].minutes + exercise_minutes(match["exercise"])
        return (f"| {stage} {match['name']} | {match['run']} | {times[stage].reading_cell} "
                f"| {match['exercise']} | {totals[stage]} min |")

    text = TABLE_ROW.sub(row, text)
    if missing := [stage for stage in times if stage not in totals]:
        raise ValueError(f"the instructor notes' table has no row for stages {missing}")

    def stage_sum(match: re.Match) -> str:
        first, last = int(match.group(2)), int(match.group(3))
        total = sum(minutes for stage, minutes in totals.items()
                    if first <= stage_number(stage) <= last)
        return match.group(1) + format_duration(total) + "".join(match.groups()[4:])

    for pattern in STAGE_SUMS:
        text = pattern.sub(stage_sum, text)
    return text


def updated_header(notebook: dict, minutes: int) -> bool:
    """Set "about N minutes to read and run" in the first cell; True if it changed.

    Raises ValueError when the first cell is not markdown or has no such phrase.
    """
    cell = notebook["cells"][0]
    if cell["cell_type"] != "markdown":
        raise ValueError("the first cell is not markdown")
    for index, line in enumerate(cell["source"]):
        if HEADER_TIME.search(line):
            new_line = HEADER_TIME.sub(lambda m: f"{m.group(1)}{minutes}{m.group(3)}", line)
            cell["source"][index] = new_line
            return new_line != line
    raise ValueError("the first cell has no 'about N minutes to read and run'")


def header_minutes(notebook: dict) -> int:
    """The N of "about N minutes to read and run" in a notebook's first cell."""
    found = HEADER_TIME.search("".join(notebook["cells"][0]["source"]))
    if not found:
        raise ValueError("the first cell has no 'about N minutes to read and run'")
    return int(found.group(2))


def write_notebook(path: Path, notebook: dict) -> None:
    """Save as Jupyter does (nbformat: indent 1, non-ASCII kept, newline at the end)."""
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def format_table(times: dict[str, ReadingTime]) -> str:
    lines = [f"{'notebook':<40} {'words':>6} {'code lines':>10} {'minutes':>7}"]
    for time in times.values():
        lines.append(f"{time.notebook:<40} {time.markdown_words:>6,} {time.code_lines:>10,} "
                     f"{time.minutes:>7}")
    return "\n".join(lines)


def format_sections(notebooks: Path = NOTEBOOKS) -> str:
    lines = []
    for path in sorted(notebooks.glob("[0-9]*.ipynb")):
        lines.append(path.name)
        for section in count_sections(json.loads(path.read_text(encoding="utf-8"))):
            lines.append(f"  {section.minutes:5.1f} min  {section.markdown_words:5,} words "
                         f"{section.code_lines:4,} lines  {section.heading}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--write"], ["--sections"]):
        print("usage: python scripts/reading_times.py [--write | --sections]", file=sys.stderr)
        return 2
    times = all_reading_times()
    print(format_table(times))
    if argv == ["--sections"]:
        print(format_sections())
    if argv == ["--write"]:
        notes = INSTRUCTOR_NOTES.read_text(encoding="utf-8")
        new_notes = updated_notes(notes, times)
        if new_notes != notes:
            INSTRUCTOR_NOTES.write_text(new_notes, encoding="utf-8")
            print(f"rewrote {INSTRUCTOR_NOTES.relative_to(ROOT)}")
        for time in times.values():
            path = NOTEBOOKS / time.notebook
            notebook = json.loads(path.read_text(encoding="utf-8"))
            if updated_header(notebook, time.minutes):
                write_notebook(path, notebook)
                print(f"rewrote the header of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
