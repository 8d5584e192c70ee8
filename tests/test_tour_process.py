"""The tour on a machine that may stop it at any moment: limits that hold without output, a watchdog
over the whole budget, a summary written around every stage, and an exit status that tells.

Each stage here is a tiny Python command (sleeping, printing, failing), so the harness is tested in
seconds, apart from the notebooks and kernels it usually runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

from kvlab.tools.tour.packing import returnable_problems
from kvlab.tools.tour.runner import run_tour
from kvlab.tools.tour.stage_process import WATCHDOG_EXIT, run_with_limit
from kvlab.tools.tour.stages import Stage

ROOT = Path(__file__).resolve().parents[1]


def python_stage(out: Path, name: str, code: str, timeout_s: int = 30) -> Stage:
    return Stage(name, "environment", [sys.executable, "-c", code], out / name, timeout_s)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child that nobody reaped yet is a zombie: dead for our purpose.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def test_a_silent_stage_is_killed_at_its_limit_with_what_it_started(tmp_path):
    """The stage prints one line (its child's pid), then nothing: the limit must still hold."""
    code = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    began = time.monotonic()
    status, reason = run_with_limit([sys.executable, "-c", code], tmp_path, dict(os.environ),
                                    tmp_path / "silent.log", limit_s=3)
    took = time.monotonic() - began
    assert (status, reason) == (None, "timed out after 3 s")
    assert 3 <= took < 30, took
    grandchild = int((tmp_path / "silent.log").read_text().splitlines()[-1])
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(grandchild), "the stage's own child outlived the limit"


def test_a_timed_out_or_failed_stage_is_recorded_the_next_runs_and_the_exit_status_says(tmp_path):
    out = tmp_path / "tour"
    stages = [python_stage(out, "sleeps", "import time; time.sleep(60)", timeout_s=2),
              python_stage(out, "fails", "raise SystemExit(4)"),
              python_stage(out, "works", "print('fine')")]
    archive, status = run_tour(ROOT, out, stages, budget_s=60)
    assert [stage.status for stage in stages] == \
        ["timed out after 2 s", "failed (exit 4)", "ok"]
    assert status == 1
    assert (out / "works" / "works.log").read_text().endswith("fine\n")
    summary = (out / "SUMMARY.md").read_text()
    assert "1 of 3 stages ok" in summary and "| sleeps | timed out after 2 s |" in summary
    assert archive == tmp_path / "tour.tar.gz" and archive.is_file()

    stages = [python_stage(out, "works", "print('fine')")]
    assert run_tour(ROOT, out, stages, budget_s=60)[1] == 0


def test_stage_limits_are_cut_to_the_budget_left(tmp_path):
    """A stage's own limit longer than what is left of the budget: it is killed when the budget
    runs out, and the stages after it are recorded as skipped."""
    out = tmp_path / "tour"
    stages = [python_stage(out, "long", "import time; time.sleep(120)", timeout_s=120),
              python_stage(out, "after", "print('never')")]
    began = time.monotonic()
    _, status = run_tour(ROOT, out, stages, budget_s=12)
    assert time.monotonic() - began < 40
    assert stages[0].timeout_s in (11, 12) and stages[0].status.startswith("timed out after 1")
    assert stages[1].status.startswith("skipped:") and status == 1


def test_the_watchdog_kills_at_the_budget_then_ends_a_stuck_tour(tmp_path):
    """At the budget the watchdog calls its kill; a tour still stuck a grace period later (not
    in any stage: nothing else would stop it) is ended with WATCHDOG_EXIT."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import time
        from kvlab.tools.tour.stage_process import Watchdog
        Watchdog(1, lambda: print("budget reached", flush=True), grace_s=1).start()
        time.sleep(60)  # stuck: only the watchdog ends this
        print("not reached")
    """))
    began = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - began < 30
    assert done.returncode == WATCHDOG_EXIT
    assert done.stdout.startswith("budget reached\n") and "not reached" not in done.stdout
    assert "watchdog: still running 1 s past the budget" in done.stdout


TOUR_SCRIPT = """
import sys
from pathlib import Path
from kvlab.tools.tour.runner import run_tour
from kvlab.tools.tour.stages import Stage

out, pack = Path(sys.argv[1]), Path(sys.argv[2])
stages = [Stage("first", "environment", [sys.executable, "-c", "print('first done')"],
                out / "first", 30),
          Stage("second", "environment", [sys.executable, "-c", "import time; time.sleep(20)"],
                out / "second", 30),
          Stage("third", "environment", [sys.executable, "-c", "pass"], out / "third", 30)]
run_tour(Path.cwd(), out, stages, budget_s=60, pack_dir=pack)
"""


def _start_tour_until_second_stage_runs(tmp_path, source: str):
    """Start the tour script `source` in its own process; return (process, pack folder) once its
    summary shows the second stage running (or after 60 s)."""
    script = tmp_path / "tour.py"
    script.write_text(source)
    out, pack = tmp_path / "work" / "tour", tmp_path / "OUT"
    tour = subprocess.Popen([sys.executable, str(script), str(out), str(pack)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = pack / "SUMMARY.md"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
            summary.is_file() and "| second | running" in summary.read_text()):
        time.sleep(0.1)
    return tour, pack


def test_a_tour_killed_midway_leaves_its_summary_and_archive(tmp_path):
    """SIGKILL (what a device's hard limit does): nothing can run after it, so what is in the
    pack folder must already be the summary and the archive of the stages done so far."""
    tour, pack = _start_tour_until_second_stage_runs(tmp_path, TOUR_SCRIPT)
    summary = pack / "SUMMARY.md"
    tour.kill()
    tour.wait()
    text = summary.read_text()
    assert "| first | ok |" in text and "| second | running" in text
    assert "| third | not run |" in text
    assert sorted(path.name for path in pack.iterdir()) == ["SUMMARY.md", "tour.tar.gz"]
    with tarfile.open(pack / "tour.tar.gz") as archive:
        names = archive.getnames()
        log = archive.extractfile("tour/first/first.log").read().decode()
    assert "tour/SUMMARY.md" in names and log.endswith("first done\n")
    assert returnable_problems(pack) == []


def test_sigterm_kills_the_stage_and_records_it(tmp_path):
    """A polite stop (SIGTERM, as `timeout` sends) gets the summary updated on the way out."""
    tour, pack = _start_tour_until_second_stage_runs(tmp_path, TOUR_SCRIPT.replace(
        "run_tour(", "import signal\nfrom kvlab.tools.tour.runner import _terminate\n"
        "signal.signal(signal.SIGTERM, _terminate)\nrun_tour("))
    summary = pack / "SUMMARY.md"
    tour.send_signal(signal.SIGTERM)
    assert tour.wait(timeout=30) != 0
    assert "| second | interrupted |" in summary.read_text()
