"""How much of an exercise's answer its stage's notebook already shows (the exercise must extend the
page, not copy it: COURSE.md, "How each stage teaches", rule 4).

An answer's lines are the lines inside the `# BEGIN SOLUTION` ... `# END SOLUTION` blocks of
`solutions/stageN_*.py`: what the learner writes, which the exercise file lacks. Lines are logical
lines (a statement split over several physical lines is one). Each line and each code line of the
stage's notebooks is normalised before they are compared, so renaming a variable, rewording a
comment or breaking a line elsewhere does not hide a copy: comments and blank lines go, and every
name that is not a keyword, a builtin or an attribute becomes `_`. Lines of fewer than `MIN_TOKENS` tokens once
normalised (`return _`, `else:`, `_ += 1`) say too little to be a copy and are not counted.

    python -m kvlab.tools.exercise_overlap        # a row per stage: answer lines, on the page, share

tests/test_exercise_overlap.py holds every stage to at most `MAX_SHARE` (a quarter).
"""

from __future__ import annotations

import builtins
import io
import json
import keyword
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_SHARE", "MIN_TOKENS", "Overlap", "answer_lines", "normalise", "overlap",
           "stage_notebooks"]

MAX_SHARE = 0.25
MIN_TOKENS = 5
BLOCK = re.compile(r"^ *# BEGIN SOLUTION.*?\n(.*?)^ *# END SOLUTION", re.M | re.S)
_KEEP = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins))
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
         tokenize.ENDMARKER}


def normalise(line: str) -> tuple[str, ...]:
    """The line's tokens, comments dropped and local names as `_` (attributes and keyword
    arguments keep theirs: `cache.block_size` and `block_size=` say what a line does)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return ()
    out: list[str] = []
    depth = 0  # inside brackets, `name=` is a keyword argument
    for index, token in enumerate(tokens):
        if token.type in _SKIP:
            continue
        text = token.string
        depth += (text in "([{") - (text in ")]}") if token.type == tokenize.OP else 0
        if token.type == tokenize.NAME and text not in _KEEP:
            after = tokens[index + 1].string if index + 1 < len(tokens) else ""
            keyword_argument = depth > 0 and after == "="
            if not (out and out[-1] == ".") and not keyword_argument:
                text = "_"
        out.append(text)
    return tuple(out)


def logical_lines(source: str) -> list[str]:
    """The source's statements, each as one line (a statement over several lines joined, with a
    comment at the end of a line it spans dropped), comments and blank lines dropped; source that
    does not tokenize falls back to its physical lines."""
    source = textwrap.dedent(source)
    physical = source.splitlines()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [line.strip() for line in physical
                if line.strip() and not line.strip().startswith("#")]
    lines, first, comments = [], None, {}
    for token in tokens:
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
        elif token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if first is not None:
                rows = range(first, token.start[0] + 1)
                lines.append(" ".join(physical[row - 1][:comments.get(row)].strip()
                                      for row in rows if row <= len(physical)).strip())
            first = None
        elif token.type not in _SKIP and first is None:
            first = token.start[0]
    return lines


def answer_lines(solution: str) -> list[str]:
    """The statements inside the solution's answer blocks (hint comments and blanks left out)."""
    return [line for block in BLOCK.findall(solution) for line in logical_lines(block)]


def notebook_lines(path: Path) -> list[str]:
    """Every statement of a notebook's code cells (IPython's %magic and !shell lines left out)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [line for cell in cells if cell["cell_type"] == "code"
            for line in logical_lines("\n".join(
                line for line in "".join(cell["source"]).splitlines()
                if not line.lstrip().startswith(("%", "!"))))]


@dataclass(frozen=True)
class Overlap:
    """Of an answer's `counted` lines (long enough to be a copy), those found on the page."""

    stage: int
    counted: int
    on_page: list[str]

    @property
    def share(self) -> float:
        return len(self.on_page) / self.counted if self.counted else 0.0


def overlap(stage: int, solution: str, notebooks: list[Path]) -> Overlap:
    page = {normalise(line) for path in notebooks for line in notebook_lines(path)}
    counted = [line for line in answer_lines(solution) if len(normalise(line)) >= MIN_TOKENS]
    return Overlap(stage, len(counted), [line.strip() for line in counted
                                         if normalise(line) in page])


def stage_notebooks(root: Path, stage: int) -> list[Path]:
    """notebooks/0N_*.ipynb and its continuations (0Nb_*.ipynb)."""
    return sorted(root.glob(f"notebooks/{stage:02d}_*.ipynb")) + \
        sorted(root.glob(f"notebooks/{stage:02d}[b-z]_*.ipynb"))


def main() -> None:
    root = Path.cwd()
    print(f"{'stage':<6}{'answer lines':>13}{'on the page':>13}{'share':>8}")
    for solution in sorted(root.glob("solutions/stage*_*.py")):
        stage = int(re.match(r"stage(\d+)_", solution.name)[1])
        found = overlap(stage, solution.read_text(), stage_notebooks(root, stage))
        print(f"{stage:<6}{found.counted:>13}{len(found.on_page):>13}{found.share:>8.0%}")
        for line in found.on_page:
            print(f"        {line}")


if __name__ == "__main__":
    main()
