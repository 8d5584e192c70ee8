"""Store notebooks the way JupyterLab would save them, so opening one changes nothing.

Run after re-executing a notebook (`jupyter nbconvert --to notebook --execute --inplace ...`):

    python scripts/tidy_notebooks.py                      # every notebooks/*.ipynb
    python scripts/tidy_notebooks.py notebooks/00_the_oom_story.ipynb

What it changes (metadata and widget outputs only; code, text and other outputs stay as they are):

* the kernelspec becomes exactly what JupyterLab writes for ipykernel's kernel
  ("Python 3 (ipykernel)"). A notebook that stores "Python 3" is rewritten, and so marked modified,
  the moment JupyterLab opens it, and shows up in a learner's `git status` although they only looked.
* widget state is dropped (`metadata.widgets`, which nbconvert stores by default). Without a live
  kernel the stored state draws a dead copy of the calculator: its controls move and its output never
  changes. The display output that points at a widget goes too, so an unrun notebook shows nothing
  where the widgets will appear, rather than an error about a missing model.

tests/test_notebook_files.py holds every notebook to this.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

# What JupyterLab 4 writes into a notebook it runs on ipykernel's "python3" kernel.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

ROOT = Path(__file__).resolve().parents[1]


def is_widget_output(output: dict) -> bool:
    """True for a display output that only draws a widget (it needs the widget's live state)."""
    return WIDGET_VIEW in output.get("data", {})


def tidy(path: Path) -> bool:
    """Rewrite one notebook in place; return True if anything changed."""
    notebook = nbformat.read(path, as_version=4)
    before = nbformat.writes(notebook)
    notebook.metadata["kernelspec"] = dict(KERNELSPEC)
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if not is_widget_output(output)]
    after = nbformat.writes(notebook)
    if after != before:
        path.write_text(after + "\n", encoding="utf-8")
    return after != before


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{'tidied' if tidy(path) else 'already tidy'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
