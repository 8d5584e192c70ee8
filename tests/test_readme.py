"""The README shows real output: its `kvlab report` block must be what the command prints now."""

from pathlib import Path

from kvlab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_report_block_is_the_current_output(capsys):
    assert main(["report"]) == 0
    printed = capsys.readouterr().out.rstrip()
    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ kvlab report\n", 1)[1].split("\n```", 1)[0]
    assert block == printed, "README's kvlab report block is stale: paste the command's output"
