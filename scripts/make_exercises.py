"""Generate the learner files exercises/stageN_*.py from the answers solutions/stageN_*.py.

In an answer, each part the learner writes is a block that becomes one line at its indentation,
`raise NotImplementedError("TODO(stage N): <hint>")`:

    # BEGIN SOLUTION hint: every token of every request costs bytes_per_token
    # hint: (more hint lines are joined to the first)
    return batch * seq_len * bytes_per_token
    # END SOLUTION

An exercise that differs (the learner's work, or out of date) is kept unless --force; --check (CI)
lists the exercises that differ and writes nothing. Adding stage N: solutions/stageN_<topic>.py
with blocks, tests/exercises/test_stageN.py (pytest tests of `load_stage("stageN_<topic>.py")`
asserting with kvlab.tools.grading); run this script (details: docs/instructor_notes.md).
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# BEGIN (its hint optional), more `# hint:` lines, the answer (lazily), END at BEGIN's indentation
BLOCK = re.compile(r"^(?P<indent> *)# BEGIN SOLUTION(?: hint: (?P<hint>.*))?\n"
                   r"(?P<more>(?: *# hint: .*\n)*)(?:.*\n)*?(?P=indent)# END SOLUTION *\n", re.M)


def make_exercise(source: str, name: str) -> str:
    """The exercise for the answer file `name` ("stageN_<topic>.py", text `source`): a header, then
    every block replaced. Raises ValueError: no block, or a BEGIN or END without its partner."""
    stage = int(re.match(r"stage(\d+)_", name)[1])

    def todo(block: re.Match) -> str:
        hints = [block["hint"] or "", *re.findall(r"# hint: (.*)", block["more"])]
        hint = " ".join(part.strip() for part in hints if part.strip()) or "implement this"
        message = json.dumps(f"TODO(stage {stage}): {hint}", ensure_ascii=False)  # "..." literal
        return f'{block["indent"]}raise NotImplementedError({message})\n'

    body, blocks = BLOCK.subn(todo, source)
    alone = re.search(r"^ *(# (BEGIN|END) SOLUTION.*)", body, re.M)
    if alone:
        raise ValueError(f"solutions/{name}: {alone[1]!r} has no partner at its indentation")
    if not blocks:
        raise ValueError(f"solutions/{name}: no BEGIN/END SOLUTION block")
    return (f"# Stage {stage} exercise, generated from solutions/{name} by "
            f"scripts/make_exercises.py.\n# Replace each `raise NotImplementedError(\"TODO...\")` "
            f"with your code, then run `kvlab check {stage}`.\n\n{body}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list differences, write nothing")
    parser.add_argument("--force", action="store_true", help="overwrite exercises that differ")
    parser.add_argument("--out", type=Path, default=ROOT / "exercises", help="target folder")
    args = parser.parse_args(argv)
    wanted = {args.out / answer.name: make_exercise(answer.read_text(), answer.name)
              for answer in sorted(ROOT.glob("solutions/stage*_*.py"))}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    stale += sorted(set(args.out.glob("stage*_*.py")) - set(wanted))  # its answer is gone
    for path in stale:
        if args.check:
            print(f"out of date: {path} (run python scripts/make_exercises.py --force)")
        elif path.exists() and not args.force:
            print(f"kept {path}: it differs from solutions/ (your work? --force overwrites it)")
        elif path in wanted:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[path])
            print(f"wrote {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
