"""The GPU tour harness: notebook cells run without Jupyter, and the whole dry run end to end.

The dry run is the same harness as the GPU tour (every stage, every notebook whole, one archive
plus SUMMARY.md) on the CPU with toy sizes and Triton's interpreter, without Jupyter as on the GPU
machine, so it cannot rot between GPU runs. CI runs it with one notebook; the plan's test holds
every notebook in it, within the budget.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kvlab.tools.tour import notebook_runner
from kvlab.tools.tour.notebook_runner import (code_cells, executed_notebook,
                                              format_notebook_summary, run_notebook, strip_magics)
from kvlab.tools.tour.packing import returnable_problems
from kvlab.tools.tour.stage_process import WATCHDOG_GRACE_S
from kvlab.tools.tour.stages import (BUDGET_S, DRY_RUN_SCALE, benchmark_modules, cuda_test_files,
                                     notebook_files, plan_stages)

ROOT = Path(__file__).resolve().parents[1]

# The lent GPU machine has no Jupyter packages; a `sitecustomize` on PYTHONPATH makes them
# unimportable here too, in the tour and every process it starts.
NO_JUPYTER = """
import sys

BLOCKED = {"ipywidgets", "IPython", "ipykernel", "comm", "nbformat", "nbconvert", "nbclient",
           "nbval", "notebook", "widgetsnbextension"}


class NoJupyter:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in BLOCKED or top.startswith("jupyter"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, NoJupyter())
"""


def without_jupyter(folder: Path) -> dict[str, str]:
    """An environment for subprocesses in which no Jupyter package can be imported."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(NO_JUPYTER)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(folder), os.environ.get("PYTHONPATH")])))


def write_notebook(path: Path, *sources: str) -> Path:
    title = {"cell_type": "markdown", "metadata": {}, "source": ["# Stage 9 — a test notebook\n"]}
    cells = [title]
    cells += [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
               "source": source.splitlines(keepends=True)} for source in sources]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def test_strip_magics():
    code, skipped = strip_magics("x = 1\n%timeit f()\nif x:\n    !ls\ny = 2")
    assert skipped == ["%timeit f()", "!ls"]
    namespace: dict = {}
    exec(code, namespace)
    assert (namespace["x"], namespace["y"]) == (1, 2)
    assert strip_magics("%%bash\necho hi") == ("", ["%%bash"])


def test_cells_run_in_one_namespace_like_a_kernel(tmp_path):
    path = write_notebook(
        tmp_path / "nb.ipynb",
        "import os\nx = 6 * 7\nprint('x is', x)",
        "x + 1",                       # last expression: an execute_result
        "x;",                          # a trailing semicolon hides it
        "display('shown', 3)\n%matplotlib inline",
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "plt.plot([1, 2])",
        "open('written_here.txt', 'w').write(os.getcwd())",
        "1 / 0",
        "print('never runs')")
    run = run_notebook(path)
    assert [cell.status for cell in run.cells] == ["ok"] * 6 + ["error", "not run"]
    assert run.cells[0].text == "x is 42\n"
    assert run.cells[1].outputs[0]["data"]["text/plain"] == "43"
    assert run.cells[2].outputs == []
    assert [o["data"]["text/plain"] for o in run.cells[3].outputs] == ["'shown'", "3"]
    assert run.magics_skipped == ["%matplotlib inline"]
    assert any("image/png" in o.get("data", {}) for o in run.cells[4].outputs)
    assert (tmp_path / "written_here.txt").read_text() == str(tmp_path)  # ran in its folder
    assert run.cells[6].outputs[-1]["ename"] == "ZeroDivisionError"
    assert run.status == "error" and run.title == "Stage 9 — a test notebook"

    executed = executed_notebook(run)
    counts = [cell["execution_count"] for cell in executed["cells"] if cell["cell_type"] == "code"]
    assert counts == [1, 2, 3, 4, 5, 6, 7, None]
    summary = format_notebook_summary(run)
    assert "7 of 8 code cells" in summary and "| 6 | error |" in summary


def test_missing_interactive_package_skips_the_cell_only(tmp_path):
    path = write_notebook(tmp_path / "nb.ipynb", "import ipywidgets_absent_here as w",
                          "print('next')")
    original = notebook_runner.INTERACTIVE_ONLY
    try:
        notebook_runner.INTERACTIVE_ONLY = ("ipywidgets_absent_here",)
        run = run_notebook(path)
    finally:
        notebook_runner.INTERACTIVE_ONLY = original
    assert run.cells[0].status.startswith("skipped (ipywidgets_absent_here not installed")
    assert run.cells[1].text == "next\n" and run.status == "ok"


def test_every_cell_runs_and_the_summary_repeats_the_gpu_cells(tmp_path):
    path = write_notebook(tmp_path / "nb.ipynb", "import torch", "y = 1\nprint(y)",
                          "if torch.cuda.is_available():\n    pass\nelse:\n    print('no GPU')")
    run = run_notebook(path)
    assert [cell.status for cell in run.cells] == ["ok", "ok", "ok"]
    summary = format_notebook_summary(run)
    assert "## GPU cells: what they printed" in summary and "no GPU" in summary


def test_timeout_stops_the_notebook(tmp_path):
    path = write_notebook(tmp_path / "nb.ipynb", "import time\ntime.sleep(30)\nprint('slept')",
                          "print(1)")
    run = run_notebook(path, timeout_s=1)
    # The sleep itself was cut: the cell ended in the TimeoutError, never reaching its print.
    assert run.cells[0].outputs[-1]["ename"] == "TimeoutError"
    assert not any("slept" in output.get("text", "") for output in run.cells[0].outputs)
    assert run.cells[1].status == "not run"


def test_benchmark_results_are_reused_not_rerun(tmp_path, monkeypatch):
    import kvlab.tools.bench_paged_attention as bench

    monkeypatch.setattr(bench, "main", bench.main)  # restored after the test
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"goal": {"pct_of_copy": 1.0}}))
    notebook_runner._reuse_results([f"bench_paged_attention={saved}"])
    from kvlab.tools.bench_paged_attention import main as run_benchmark

    assert run_benchmark(["--out", "anywhere"]) == {"goal": {"pct_of_copy": 1.0}}


def test_stages_are_found_from_the_repository(tmp_path):
    assert ROOT / "tests" / "test_triton_paged_attention.py" in cuda_test_files(ROOT)
    assert "kvlab.tools.bench_paged_attention" in benchmark_modules(ROOT)
    every = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    assert [path.name for path in notebook_files(ROOT)] == [path.name for path in every]
    assert [p.name[:2] for p in notebook_files(ROOT, ["00", "04"])][:2] == ["00", "04"]  # by choice
    stages = plan_stages(ROOT, tmp_path, dry_run=True)
    assert [stage.kind for stage in stages[:2]] == ["environment", "tests"]
    kinds = [stage.kind for stage in stages]
    assert kinds.index("story") > kinds.index("benchmark") and kinds[-1] == "notebook"
    assert [s.name for s in stages if s.kind == "story"] == ["oom_story"]
    assert all("--dry-run" in s.command or "--toy" in s.command for s in stages
               if s.kind not in ("tests", "notebook"))
    assert all(s.command[1:3] == ["-m", "kvlab.tools.tour.triton_compat"] for s in stages)
    # Every name travels back from the device (no spaces).
    assert all(re.fullmatch(r"[A-Za-z0-9_]+", stage.name) for stage in stages)


@pytest.mark.parametrize("dry_run", [False, True], ids=["gpu", "dry_run"])
def test_the_plan_runs_every_notebook_within_the_budget(tmp_path, dry_run):
    """The GPU edition is every notebook of the course, each in its own process, and every stage
    run to its limit still ends inside the budget, which with the install and the watchdog's grace
    fits one 10-minute command of the lent machine (docs/gpu_tour.md)."""
    planned = plan_stages(ROOT, tmp_path, dry_run)
    notebooks = [stage for stage in planned if stage.kind == "notebook"]
    assert [stage.name for stage in notebooks] == [
        path.stem for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))]
    assert all(len([part for part in stage.command if part.endswith(".ipynb")]) == 1
               for stage in notebooks)  # one process each
    budget = BUDGET_S * (DRY_RUN_SCALE if dry_run else 1)
    assert sum(stage.timeout_s for stage in planned) <= budget
    assert BUDGET_S + WATCHDOG_GRACE_S + 30 <= 10 * 60  # 30 s: the offline install, the margin


def test_tour_and_benchmark_share_one_environment_record():
    """One function describes the machine and measures its copy bandwidth for both commands."""
    import kvlab.tools.machine
    import kvlab.tools.bench_paged_attention as bench
    from kvlab.tools.tour import environment as tour_environment

    assert bench.describe_environment is kvlab.tools.machine.describe_environment
    assert tour_environment.describe_environment is kvlab.tools.machine.describe_environment
    assert bench.FULL.copy_bytes == kvlab.tools.machine.GPU_COPY_BYTES  # the same copy on a GPU
    info = tour_environment.tour_environment(dry_run=True)
    assert info["device"] == "cpu" and info["copy_bytes"] == tour_environment.CPU_COPY_BYTES
    assert set(info) == set(kvlab.tools.machine.describe_environment("cpu", "any", copy_bytes=1))
    text = tour_environment.format_environment(info)
    for value in (info["card"], info["dtype"], info["torch"], str(info["numpy"]), info["cpu"]):
        assert value in text
    assert "Not measured on a GPU" in text


def test_without_jupyter_notebook_00_runs_every_cell(tmp_path):
    """Its calculator cell imports ipywidgets: without it the sliders are left out, and the
    presets, the calculator and every later cell still run."""
    env = without_jupyter(tmp_path / "site")
    done = subprocess.run([sys.executable, "-m", "kvlab.tools.tour.notebook_runner",
                           str(ROOT / "notebooks" / "00_the_oom_story.ipynb"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "out" / "00_the_oom_story.md").read_text()
    assert "error" not in summary and "skipped" not in summary
    assert "ipywidgets is not installed: no sliders here" in summary
    executed = json.loads((tmp_path / "out" / "00_the_oom_story.ipynb").read_text())
    assert all(cell["execution_count"] for cell in executed["cells"]
               if cell["cell_type"] == "code")


def test_dry_run_end_to_end(tmp_path):
    """The prepared command, as CI runs it, without Jupyter as on the GPU machine: every stage ok,
    every summary written, and in the pack folder only what the device hands back."""
    out, pack = tmp_path / "tour", tmp_path / "OUT"
    # One notebook, whole (the plan runs them all; each takes up to 2 minutes on a CPU).
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tour.py"), "--dry-run",
                           "--out", str(out), "--pack", str(pack), "--notebooks", "01"],
                          capture_output=True, text=True, timeout=1500,
                          env=without_jupyter(tmp_path / "site"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "SUMMARY.md").read_text()
    assert "not measured on a GPU" in summary
    assert "| environment | ok |" in summary and "| cuda_tests | ok |" in summary
    assert "| bench_paged_attention | ok |" in summary
    # Stage 7's out-of-memory story, on the CPU: the naive run met the (emulated) limit, every
    # request of both runs finished, and the headline says it is a dry run.
    assert "| oom_story | ok |" in summary and "- oom_story (dry run on the CPU): naive: " \
        "torch.OutOfMemoryError at" in summary
    story = json.loads((out / "oom_story" / "oom_story.json").read_text())
    assert [run["strategy"] for run in story["runs"]] == ["naive", "paged+prefix"]
    assert all(run["finished"] == run["requests"] for run in story["runs"])
    assert story["runs"][0]["out_of_memory_errors"] >= 1
    assert story["runs"][1]["blocks_in_use_at_end"] == 0
    assert "not measured on a GPU" in (out / "oom_story" / "oom_story.md").read_text()
    for path in notebook_files(ROOT, ["01"]):
        assert f"| {path.stem} | ok |" in summary, path.name
        executed = json.loads((out / "notebooks" / path.name).read_text())
        cells = [cell for cell in executed["cells"] if cell["cell_type"] == "code"]
        assert len(cells) == len(code_cells(json.loads(path.read_text())))
        assert all(cell["execution_count"] for cell in cells)  # every cell ran
        assert (out / "notebooks" / f"{path.stem}.md").is_file()
    environment = json.loads((out / "environment" / "environment.json").read_text())
    assert environment["device"] == "cpu" and environment["copy_gb_s"] > 0
    assert "passed" in (out / "tests" / "tests.md").read_text()
    assert "== 1/" in done.stdout and "archive:" in done.stdout  # progress printed
    # What the device would hand back from $OUT: the summary and one archive, nothing lost.
    assert sorted(path.name for path in pack.iterdir()) == ["SUMMARY.md", "tour.tar.gz"]
    assert returnable_problems(pack) == []
    assert (pack / "SUMMARY.md").read_text() == summary
    with tarfile.open(pack / "tour.tar.gz") as archive:
        names = archive.getnames()
    assert "tour/SUMMARY.md" in names and "tour/environment/environment.json" in names
    assert "tour/benchmarks/bench_paged_attention.json" in names
    assert "tour/oom_story/oom_story.md" in names and "tour/tests/cuda_tests.log" in names
    assert all(" " not in name for name in names)


def test_gpu_mode_refuses_without_a_gpu(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real tour would run")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tour.py"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA GPU here; use --dry-run" in done.stderr


def test_the_readme_links_every_gpu_edition():
    """A GPU run committed under results/gpu/<card>-<date>/ is linked from the README (none yet)."""
    readme = (ROOT / "README.md").read_text()
    for edition in sorted((ROOT / "results" / "gpu").glob("*/")):
        assert f"results/gpu/{edition.name}" in readme, edition.name
