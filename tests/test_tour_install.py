"""Before any stage: the package must be installed (kvlab.tools is mapped from tools/ and
kvlab.kernels from kernels/), and a failed install of carried wheels is reported, never the end of
the tour."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvlab.tools.tour import runner
from kvlab.tools.tour.runner import INSTALL_HINT, prepare_packages

ROOT = Path(__file__).resolve().parents[1]


def test_a_pip_failure_is_a_note_not_the_end_of_the_tour(tmp_path, capsys):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "kvlab_absent_pkg-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    notes = prepare_packages(wheels, ("kvlab_absent_pkg",))
    assert notes[0].startswith(f"- pip install from {wheels} failed:")
    assert notes[1] == "- missing here: kvlab_absent_pkg (stages that need them failed)"
    assert "the tour goes on without them" in capsys.readouterr().out
    assert prepare_packages(None, ("json",)) == []  # nothing missing, nothing to install


def test_the_tour_runs_on_after_a_pip_failure(tmp_path, monkeypatch):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    monkeypatch.setattr(runner, "NEEDED_MODULES", ("kvlab_absent_pkg",))
    out, pack = tmp_path / "tour", tmp_path / "OUT"
    status = runner.main(["--dry-run", "--out", str(out), "--pack", str(pack), "--wheels",
                          str(wheels), "--notebooks", "02", "--skip", "environment", "tests",
                          "benchmark", "story", "notebook"], repo=ROOT)
    assert status == 0  # no stage was asked for, so none failed
    summary = (pack / "SUMMARY.md").read_text()
    assert "pip install from" in summary and "failed" in summary
    assert "- missing here: kvlab_absent_pkg" in summary


def test_without_the_install_the_tour_says_how_to_install(tmp_path):
    """kvlab from its source folder alone (no site-packages, so no editable install): tools/ is
    not kvlab.tools, and scripts/gpu_tour.py stops before any stage with the one line."""
    script = ROOT / "scripts" / "gpu_tour.py"
    code = (f"import sys, runpy; sys.path[:0] = [{str(ROOT / 'src')!r}]; "
            f"sys.argv = [{str(script)!r}, '--dry-run', '--out', {str(tmp_path / 'out')!r}]; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert "cannot import kvlab.tools" in done.stderr and INSTALL_HINT in done.stderr
    assert not (tmp_path / "out").exists()


def test_without_the_kernels_the_tour_says_how_to_install(tmp_path, monkeypatch, capsys):
    """The tour imported but kvlab.kernels not (a partial install): it stops before any stage
    with the one line."""
    real_find_spec = runner.importlib.util.find_spec
    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name, *args: (
        None if name == "kvlab.kernels" else real_find_spec(name, *args)))
    status = runner.main(["--dry-run", "--out", str(tmp_path / "out")], repo=ROOT)
    err = capsys.readouterr().err
    assert status == 2 and "kvlab.kernels cannot be imported" in err and INSTALL_HINT in err
    assert not (tmp_path / "out").exists()


def test_the_documented_command_installs_first_then_tours_into_out():
    """docs/gpu_tour.md's one command, as pasted into the device tool: at most 2,000 characters,
    the offline install before the tour, the tour packed into $OUT, and its outer `timeout`
    behind the watchdog (budget + grace), inside the lent machine's 10-minute command."""
    import re

    from kvlab.tools.tour.stage_process import WATCHDOG_GRACE_S
    from kvlab.tools.tour.stages import BUDGET_S

    text = (ROOT / "docs" / "gpu_tour.md").read_text()
    section = text.split("## The one command for a lent GPU machine", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert "\n" not in command and len(command) <= 2000
    assert command.index(INSTALL_HINT.replace("pip", "python3 -m pip", 1)) < \
        command.index("scripts/gpu_tour.py")
    assert 'scripts/gpu_tour.py --pack "$OUT"' in command
    outer = int(re.search(r"timeout -k (\d+) (\d+) python3 scripts/gpu_tour.py", command)[2])
    assert BUDGET_S + WATCHDOG_GRACE_S < outer <= 10 * 60 - 15
    assert "--dry-run" not in command
