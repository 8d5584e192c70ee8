"""Notebooks as stored: opening one in JupyterLab must not change it, and no dead widgets.

`scripts/tidy_notebooks.py` puts a notebook in this shape after it is re-executed.
tests/test_browser.py checks the same in a real JupyterLab (the tab must not turn "modified").
"""

import ast
import importlib.util
import json
import os
import re
import textwrap
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


def colab_first_cell() -> str:
    """The first cell docs/colab.md gives (its first python block, dedented)."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "colab.md").read_text(), re.S)
    return textwrap.dedent(block.group(1)).rstrip("\n")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_first_code_cell_is_the_one_colab_md_gives(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    first = next(cell for cell in cells if cell["cell_type"] == "code")
    assert "".join(first["source"]) == colab_first_cell()


REAL_FIND_SPEC = importlib.util.find_spec  # before any test replaces it


def run_first_cell(monkeypatch, capsys, cwd, kvlab_installed):
    """Execute the Colab cell in `cwd` with pip stubbed out; return (pip commands, printed text)."""
    import subprocess

    import torch

    commands = []
    real_find_spec = REAL_FIND_SPEC
    # setup() sets TRITON_INTERPRET and torch's thread count: both are put back after the test.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n, _real=torch.set_num_threads: None)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("KVLAB_SOURCE", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name == "kvlab" and not kvlab_installed else real_find_spec(name, *args)))
    namespace = {}
    exec(compile(colab_first_cell(), "first cell", "exec"), namespace)
    return commands, capsys.readouterr().out, namespace


def test_first_cell_installs_the_course_only_when_kvlab_is_missing(monkeypatch, capsys):
    import sys

    commands, out, namespace = run_first_cell(monkeypatch, capsys, ROOT / "notebooks", False)
    assert commands == [[sys.executable, "-m", "pip", "install", "-q", str(ROOT)]]
    assert out.startswith(f"kvlab is not installed here: pip install {ROOT} (the torch already")
    assert "kvlab setup: " in out and namespace["env"].seed == 0

    commands, out, _ = run_first_cell(monkeypatch, capsys, ROOT / "notebooks", True)
    assert commands == [] and out.startswith("kvlab setup: ")


def test_first_cell_outside_a_clone_stops_with_what_to_do_or_installs_kvlab_source(
        monkeypatch, capsys, tmp_path):
    import subprocess
    import sys

    (tmp_path / "content").mkdir()  # Colab: the notebook alone, in /content; no public URL yet
    with pytest.raises(RuntimeError, match=r"not in a copy of the course: .* set KVLAB_SOURCE"):
        run_first_cell(monkeypatch, capsys, tmp_path / "content", False)
    commands = []  # the stubs run_first_cell put in place are still there; record pip anew
    monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
    monkeypatch.setenv("KVLAB_SOURCE", "kvlab-0.1.0-py3-none-any.whl")
    exec(compile(colab_first_cell(), "first cell", "exec"), {})
    assert commands == [[sys.executable, "-m", "pip", "install", "-q",
                         "kvlab-0.1.0-py3-none-any.whl"]]


def test_first_cells_course_url_is_the_projects_repository_url():
    """The cell's fallback outside a clone is pyproject's [project.urls] Repository, or None."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {})
    found = re.search(r"^ *COURSE_URL = (.+?)  #", colab_first_cell(), re.M)
    assert found, "the first cell no longer names COURSE_URL"
    expected = f"git+{urls['Repository']}" if "Repository" in urls else None
    assert ast.literal_eval(found.group(1)) == expected, (
        f"COURSE_URL in the first cell and pyproject's [project.urls] Repository differ")


def test_readme_stage_table_points_at_files_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Where each stage's code lives", 1)[1].split("\n## ", 1)[0]
    targets = re.findall(r"\]\(([^)#\s]+)\)", section)
    assert len(targets) > 30, targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README stage table links to missing files: {missing}"
    linked_notebooks = {target for target in targets if target.endswith(".ipynb")}
    assert linked_notebooks == {f"notebooks/{path.name}" for path in NOTEBOOKS}
