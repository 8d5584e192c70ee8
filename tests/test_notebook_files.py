"""Notebooks as stored: opening one in JupyterLab must not change it, and no dead widgets.

`scripts/tidy_notebooks.py` puts a notebook in this shape after it is re-executed.
tests/test_browser.py checks the same in a real JupyterLab (the tab must not turn "modified").
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# What JupyterLab 4 writes when it opens a notebook on ipykernel's python3 kernel. A notebook storing
# anything else ("Python 3") is rewritten, and shown as modified, as soon as a learner opens it.
JUPYTERLAB_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python",
                         "name": "python3"}


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_kernelspec_is_what_jupyterlab_writes(path):
    metadata = json.loads(path.read_text(encoding="utf-8"))["metadata"]
    assert metadata.get("kernelspec") == JUPYTERLAB_KERNELSPEC, (
        f"{path.name}: kernelspec {metadata.get('kernelspec')}; run scripts/tidy_notebooks.py")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_no_stored_widget_state(path):
    notebook = json.loads(path.read_text(encoding="utf-8"))
    assert "widgets" not in notebook["metadata"], (
        f"{path.name} stores widget state (a dead copy of its widgets); run "
        "scripts/tidy_notebooks.py after executing it")
    widget_cells = [index for index, cell in enumerate(notebook["cells"])
                    for output in cell.get("outputs", [])
                    if "application/vnd.jupyter.widget-view+json" in output.get("data", {})]
    assert not widget_cells, f"{path.name}: cells {widget_cells} store a widget view"


def test_images_in_readme_and_docs_exist():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).is_file(), f"{page.name}: missing image {target}"
