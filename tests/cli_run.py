"""`run(capsys, *argv)`: the `kvlab` command in-process, for the CLI tests."""

from __future__ import annotations

from kvlab.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit status, stdout, stderr); argparse errors exit via SystemExit."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
