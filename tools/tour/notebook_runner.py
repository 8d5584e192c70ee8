"""Execute a notebook's code cells without Jupyter, capturing what each cell prints.

    python -m kvlab.tools.tour.notebook_runner --out DIR [--reuse NAME=JSON] NB.ipynb...

The GPU machine has no Jupyter packages, so this reads the .ipynb file as JSON (the nbformat 4
layout: `cells`, each with `cell_type` and `source`) and runs every code cell, top to bottom, in one
namespace, as a kernel would:

* IPython-only lines (`%magic`, `!shell`) are skipped and reported; a `%%cell magic` skips the cell;
* the value of a cell's last expression is recorded (unless the line ends with `;`), as Jupyter
  shows it; `display(...)` records its arguments;
* matplotlib figures still open after a cell are saved as PNG outputs and closed (Agg backend);
* the first error stops the notebook, as `jupyter nbconvert --execute` does — except a cell that
  needs an interactive-only package (ipywidgets, IPython) that is not installed: a widget has no
  meaning without a browser, so that cell is marked skipped and the notebook goes on.

The executed copy (outputs in nbformat, so Jupyter can open it) and a Markdown summary go to DIR:
on a GPU, the course's GPU edition of that notebook (every cell on the card, `kvlab.device`); in the
dry run (`CUDA_VISIBLE_DEVICES=""`), the same notebook on the CPU. The summary repeats what the
cells that name `cuda` printed (`is_gpu_cell`: the ones whose GPU path differs). `--reuse
NAME=JSON` makes `kvlab.tools.NAME.main` return that JSON instead of running again (the tour runs
each benchmark once, as its own stage, before the notebooks that call it).
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import copy
import dataclasses
import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["CellRun", "NotebookRun", "code_cells", "strip_magics", "is_gpu_cell", "run_notebook",
           "format_notebook_summary", "main"]


@dataclasses.dataclass
class CellRun:
    """One code cell: its index among code cells, wall seconds, status ('ok', 'error',
    'not run'), outputs in nbformat 4 form, and the text it printed."""

    index: int
    source: str
    seconds: float = 0.0
    status: str = "not run"
    outputs: list[dict] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        parts = []
        for output in self.outputs:
            if output["output_type"] == "stream":
                parts.append(output["text"])
            elif output["output_type"] in ("execute_result", "display_data"):
                parts.append(output["data"].get("text/plain", "") + "\n")
            elif output["output_type"] == "error":
                parts.append(f"{output['ename']}: {output['evalue']}\n")
        return "".join(parts)


@dataclasses.dataclass
class NotebookRun:
    """A notebook's run: path, title (its first heading), cells, seconds, skipped magic lines."""

    path: Path
    title: str
    cells: list[CellRun]
    seconds: float
    magics_skipped: list[str]

    @property
    def status(self) -> str:
        if any(cell.status == "error" for cell in self.cells):
            return "error"
        return "ok"


def code_cells(notebook: dict) -> list[str]:
    """The sources of the notebook's code cells, in order (nbformat 4 stores lists of lines)."""
    return ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            for cell in notebook["cells"] if cell["cell_type"] == "code"]


def strip_magics(source: str) -> tuple[str, list[str]]:
    """(source with IPython-only lines replaced by `pass`, the lines skipped). A cell magic
    (`%%...` on the first line) skips the whole cell."""
    if source.lstrip().startswith("%%"):
        return "", [source.lstrip().splitlines()[0]]
    kept, skipped = [], []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            skipped.append(stripped)
            kept.append(line[: len(line) - len(stripped)] + "pass  # IPython-only line skipped")
        else:
            kept.append(line)
    return "\n".join(kept), skipped


def _title(notebook: dict, path: Path) -> str:
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return path.stem


class _Recorder:
    """Collects one cell's outputs: `display()` calls, the last expression, figures."""

    def __init__(self) -> None:
        self.outputs: list[dict] = []

    def display(self, *objects: Any) -> None:
        for obj in objects:
            self.outputs.append({"output_type": "display_data", "metadata": {},
                                 "data": {"text/plain": repr(obj)}})

    def figures(self) -> None:
        """Save every open matplotlib figure as a PNG output and close it (inline backend)."""
        if "matplotlib.pyplot" not in sys.modules:
            return
        plt = sys.modules["matplotlib.pyplot"]
        for number in plt.get_fignums():
            buffer = io.BytesIO()
            plt.figure(number).savefig(buffer, format="png", dpi=80, bbox_inches="tight")
            self.outputs.append({"output_type": "display_data", "metadata": {}, "data": {
                "image/png": base64.b64encode(buffer.getvalue()).decode(),
                "text/plain": f"<Figure {number}>"}})
        plt.close("all")


# Packages that only drive a live Jupyter front end: a cell that needs a missing one is skipped.
INTERACTIVE_ONLY = ("ipywidgets", "IPython")


def _run_cell(code: str, namespace: dict, filename: str, recorder: _Recorder) -> str:
    """Execute one cell's code; 'ok', 'error', or 'skipped (...)' for a missing interactive-only
    package. Outputs go to `recorder`."""
    stdout, stderr = io.StringIO(), io.StringIO()
    namespace["display"] = recorder.display
    status = "ok"
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            tree = ast.parse(code, filename)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr) and \
                    not code.rstrip().endswith(";"):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), namespace)
            if last is not None:
                value = eval(compile(last, filename, "eval"), namespace)
                if value is not None:
                    recorder.outputs.append({"output_type": "execute_result", "metadata": {},
                                             "execution_count": None,
                                             "data": {"text/plain": repr(value)}})
        except BaseException as error:  # noqa: BLE001 - a cell's failure is recorded, not raised
            if isinstance(error, KeyboardInterrupt):
                raise
            if isinstance(error, ModuleNotFoundError) and error.name in INTERACTIVE_ONLY:
                status = f"skipped ({error.name} not installed; interactive only)"
                print(f"{error.name} is not installed: this interactive cell is skipped")
            else:
                status = "error"
                frames = traceback.format_exception(type(error), error, error.__traceback__)
                recorder.outputs.append({"output_type": "error", "ename": type(error).__name__,
                                         "evalue": str(error),
                                         "traceback": [frame for frame in frames
                                                       if "tools/tour/" not in frame]})
    # The printed text comes before the other outputs, as in Jupyter; then any open figures.
    streams = [{"output_type": "stream", "name": name, "text": buffer.getvalue()}
               for name, buffer in (("stdout", stdout), ("stderr", stderr)) if buffer.getvalue()]
    recorder.outputs[:0] = streams
    recorder.figures()
    return status


def _cell_timeout(signum, frame):
    raise TimeoutError("the notebook ran past the tour's time limit for it")


# A GPU cell names CUDA (its `torch.cuda.is_available()` branch): the summary repeats its output.
GPU_CELL_MARK = "cuda"


def is_gpu_cell(source: str) -> bool:
    """True for a code cell that takes a GPU path when CUDA is there."""
    return GPU_CELL_MARK in source


def run_notebook(path: Path, timeout_s: int | None = None) -> NotebookRun:
    """Execute the notebook's code cells in its own folder (relative paths work as in Jupyter).

    timeout_s: wall seconds for the whole notebook (SIGALRM; the cell running then gets a
    TimeoutError and the notebook stops there).
    """
    notebook = json.loads(Path(path).read_text())
    cells = [CellRun(i, source) for i, source in enumerate(code_cells(notebook))]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    magics: list[str] = []
    start, previous = time.perf_counter(), Path.cwd()
    if timeout_s:
        signal.signal(signal.SIGALRM, _cell_timeout)
        signal.alarm(timeout_s)
    if "matplotlib.pyplot" in sys.modules:  # a fresh kernel has no figures: earlier code's
        sys.modules["matplotlib.pyplot"].close("all")  # must not show up in this notebook
    try:
        os.chdir(Path(path).resolve().parent)
        for cell in cells:
            code, skipped = strip_magics(cell.source)
            magics += skipped
            recorder, began = _Recorder(), time.perf_counter()
            cell.status = _run_cell(code, namespace, f"<{Path(path).name} cell {cell.index}>",
                                    recorder)
            cell.seconds, cell.outputs = time.perf_counter() - began, recorder.outputs
            print(f"  {Path(path).stem} cell {cell.index}: {cell.status} "
                  f"({cell.seconds:.1f} s)", file=sys.__stdout__, flush=True)
            if cell.status == "error":
                break
    finally:
        if timeout_s:
            signal.alarm(0)
        os.chdir(previous)
    return NotebookRun(Path(path), _title(notebook, Path(path)), cells,
                       time.perf_counter() - start, magics)


def executed_notebook(run: NotebookRun) -> dict:
    """The original notebook with this run's outputs and execution counts in its code cells."""
    notebook = copy.deepcopy(json.loads(run.path.read_text()))
    code = iter(run.cells)
    count = 0
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        result = next(code)
        ran = result.status != "not run"
        count += ran
        cell["execution_count"] = count if ran else None
        cell["outputs"] = [dict(output, execution_count=count) if output["output_type"] ==
                           "execute_result" else output for output in result.outputs]
    return notebook


def format_notebook_summary(run: NotebookRun) -> str:
    """Markdown: status and time, one row per code cell, then the full output of the GPU cells."""
    executed = [cell for cell in run.cells if cell.status != "not run"]
    lines = [f"# {run.title}", "", f"`{run.path.name}`: {run.status}, {len(executed)} of "
             f"{len(run.cells)} code cells run in {run.seconds:.1f} s.", ""]
    if run.magics_skipped:
        lines += [f"IPython-only lines skipped: {', '.join(f'`{m}`' for m in run.magics_skipped)}",
                  ""]
    lines += ["| cell | status | seconds | first line printed |", "|---|---|---|---|"]
    for cell in executed:
        first = next((line for line in cell.text.splitlines() if line.strip()), "")
        first = first.replace("|", "\\|")[:100]
        lines.append(f"| {cell.index} | {cell.status} | {cell.seconds:.2f} | {first} |")
    gpu_cells = [cell for cell in executed if is_gpu_cell(cell.source) and cell.index > 0]
    if gpu_cells:
        lines += ["", "## GPU cells: what they printed", ""]
        for cell in gpu_cells:
            lines += [f"Cell {cell.index}:", "", "```text", cell.text.rstrip() or "(nothing)",
                      "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _reuse_results(specs: list[str]) -> None:
    """For each NAME=JSON: kvlab.tools.NAME.main(...) returns the saved results, not a rerun."""
    import importlib

    for spec in specs:
        name, _, path = spec.partition("=")
        module = importlib.import_module(f"kvlab.tools.{name}")
        saved = json.loads(Path(path).read_text())

        def reuse(argv=None, _name=name, _path=path, _saved=saved):
            print(f"gpu tour: {_name} already ran as the tour's benchmark stage; reusing its "
                  f"results from {_path}")
            return _saved

        module.main = reuse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=int, default=None, help="seconds per notebook")
    parser.add_argument("--reuse", action="append", default=[], metavar="NAME=JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    _reuse_results(args.reuse)
    failed = 0
    for path in args.notebooks:
        run = run_notebook(path, timeout_s=args.timeout)
        (args.out / path.name).write_text(json.dumps(executed_notebook(run), indent=1) + "\n")
        (args.out / f"{path.stem}.md").write_text(format_notebook_summary(run))
        failed += run.status != "ok"
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
