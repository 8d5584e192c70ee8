"""Notebooks as stored: opening one in JupyterLab must not change it, and no dead widgets.

`scripts/tidy_notebooks.py` puts a notebook in this shape after it is re-executed.
tests/test_browser.py checks the same in a real JupyterLab (the tab must not turn "modified").
"""

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from kvlab.device import default_device

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


def colab_first_cell() -> str:
    """The first cell docs/colab.md gives (its first python block, dedented)."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "colab.md").read_text(), re.S)
    return textwrap.dedent(block.group(1)).rstrip("\n")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_first_code_cell_is_the_one_colab_md_gives(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    first = next(cell for cell in cells if cell["cell_type"] == "code")
    assert "".join(first["source"]) == colab_first_cell()


def test_first_cell_is_one_line_that_sets_up_the_course(monkeypatch, capsys):
    """One line, the same everywhere; installing the course is docs/colab.md's step 1."""
    import torch

    assert len(colab_first_cell().splitlines()) == 1
    # setup() sets TRITON_INTERPRET and torch's thread count: both are put back after the test.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n, _real=torch.set_num_threads: None)
    namespace = {}
    exec(compile(colab_first_cell(), "first cell", "exec"), namespace)
    assert capsys.readouterr().out.startswith("kvlab setup: ")
    assert namespace["env"].seed == 0 and namespace["env"].device == str(default_device())


def test_readme_stage_table_points_at_files_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Where each stage's code lives", 1)[1].split("\n## ", 1)[0]
    targets = re.findall(r"\]\(([^)#\s]+)\)", section)
    assert len(targets) > 30, targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README stage table links to missing files: {missing}"
    linked_notebooks = {target for target in targets if target.endswith(".ipynb")}
    assert linked_notebooks == {f"notebooks/{path.name}" for path in NOTEBOOKS}
