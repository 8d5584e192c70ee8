"""Generate the learner files exercises/stageN_*.py from the answers solutions/stageN_*.py.

    python scripts/make_exercises.py            # write missing and out-of-date exercises
    python scripts/make_exercises.py --check    # CI: list what differs, exit 1; writes nothing

In an answer file every part the learner writes is fenced by markers; the block becomes one line
at the same indentation, `raise NotImplementedError("TODO(stage N): <hint>")`:

    # BEGIN SOLUTION hint: every token of every request costs bytes_per_token
    # hint: (further hint lines are joined to the first)
    return batch * seq_len * bytes_per_token
    # END SOLUTION

A file the learner has edited is never overwritten (each generated file records a hash of what
was generated; --force overwrites anyway). --out DIR writes into another folder.

Adding stage N: write solutions/stageN_<topic>.py with markers and tests/exercises/test_stageN.py
(plain pytest tests; a module fixture `ex` returning `load_stage("stageN_<topic>.py")`; asserts
from kvlab.grading, whose one-line messages name the input, as `kvlab check` prints them); run
this script; then `kvlab check N --target solutions` passes and `kvlab check N` shows TODOs.
tests/test_exercises_system.py checks both for every stage, and that exercises/ is current.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A BEGIN line (its hint optional), more `# hint:` lines, the answer's lines (as few as can be),
# and the END line at the BEGIN line's indentation.
BLOCK = re.compile(r"^(?P<indent> *)# BEGIN SOLUTION(?: hint: (?P<hint>.*))?\n"
                   r"(?P<more>(?: *# hint: .*\n)*)(?:.*\n)*?(?P=indent)# END SOLUTION *\n", re.M)
HASH_TAG = "# hash of the generated text:"


def make_exercise(source: str, stage: int, name: str) -> str:
    """The exercise for answer file `name` (text `source`): a header, then every block replaced.

    Raises:
        ValueError: no blocks; a BEGIN without its END at the same indentation (or an END alone);
            a result that is not valid Python.
    """
    def todo(block: re.Match) -> str:
        hints = [block["hint"] or ""] + [line.split("# hint:", 1)[1]
                                         for line in block["more"].splitlines()]
        hint = " ".join(part.strip() for part in hints if part.strip()) or "implement this"
        message = json.dumps(f"TODO(stage {stage}): {hint}", ensure_ascii=False)  # "..." literal
        return f'{block["indent"]}raise NotImplementedError({message})\n'

    body, blocks = BLOCK.subn(todo, source)
    left = [line.strip() for line in body.splitlines()
            if re.match(r" *# (BEGIN|END) SOLUTION", line)]
    if not blocks or left:
        raise ValueError(f"solutions/{name}: no BEGIN/END SOLUTION block" if not blocks else
                         f"solutions/{name}: {left[0]!r} has no partner at its indentation")
    try:
        compile(body, f"exercises/{name}", "exec", dont_inherit=True)
    except SyntaxError as error:
        raise ValueError(f"exercises/{name} would not be valid Python: {error}") from None
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return (f"# Stage {stage} exercise, generated from solutions/{name} by "
            f"scripts/make_exercises.py.\n# Replace each `raise NotImplementedError(\"TODO...\")` "
            f"with your code, then run `kvlab check {stage}`.\n{HASH_TAG} {digest}\n\n{body}")


def is_untouched(text: str) -> bool:
    """True when a generated exercise still holds exactly what was generated (not yet edited)."""
    header, _, body = text.partition("\n\n")
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return header.splitlines()[-1:] == [f"{HASH_TAG} {digest}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list differences, write nothing")
    parser.add_argument("--force", action="store_true", help="overwrite edited exercises too")
    parser.add_argument("--out", type=Path, default=ROOT / "exercises", help="target folder")
    args = parser.parse_args(argv)
    wanted = {}
    for answer in sorted((ROOT / "solutions").glob("stage*_*.py")):
        stage = int(re.match(r"stage(\d+)_", answer.name)[1])
        wanted[args.out / answer.name] = make_exercise(answer.read_text(), stage, answer.name)
    extra = sorted(set(args.out.glob("stage*_*.py")) - set(wanted))  # its answer is gone
    stale = [path for path, text in wanted.items()
             if not path.exists() or path.read_text() != text] + extra
    if args.check:
        for path in stale:
            print(f"out of date: {path} (run python scripts/make_exercises.py)")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for path in stale:
        if path.exists() and not (args.force or is_untouched(path.read_text())):
            print(f"kept {path}: you have edited it (--force overwrites it)")
        elif path in wanted:
            path.write_text(wanted[path])
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
