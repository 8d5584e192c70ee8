"""Shared set-up of the exercise tests: which folder's stageN_*.py they grade, and the report.

The tests import a learner's module from the folder named by the environment variable
`KVLAB_EXERCISES_DIR`; without it (a plain `pytest tests/`) they grade the reference answers in
`solutions/`. `kvlab check` (`kvlab.exercises.check_stage`) sets it, and also sets
`KVLAB_CHECK_REPORT`: then the hooks below write one JSON line per test (pass / fail / todo /
error / import / skip, with a readable message) for the checker to print instead of tracebacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvlab.exercises import (ENV_CHECK_REPORT, ENV_EXERCISES_DIR, classify_exception,
                             load_exercise)

ROOT = Path(__file__).resolve().parents[2]


def exercises_dir() -> Path:
    """The folder whose stageN_*.py files are graded."""
    return Path(os.environ.get(ENV_EXERCISES_DIR) or ROOT / "solutions").resolve()


@pytest.fixture(scope="session")
def load_stage():
    """load_stage("stage0_kv_size.py") -> the learner's module (ExerciseImportError if broken)."""
    directory = exercises_dir()
    return lambda filename: load_exercise(filename, directory)


# ---- the report for `kvlab check` (only when KVLAB_CHECK_REPORT is set) -----------------------

_phases: dict[str, list[tuple[str, str, str]]] = {}   # nodeid -> [(when, outcome, text)]
_classified: dict[tuple[str, str], dict] = {}         # (nodeid, when) -> classify_exception()


def _reporting() -> bool:
    return bool(os.environ.get(ENV_CHECK_REPORT))


def _short(report) -> str:
    lines = [line for line in (report.longreprtext or "").splitlines() if line.strip()]
    return "\n".join(lines[-3:])


def pytest_runtest_logreport(report):
    if not _reporting():
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    else:
        text = _short(report) if report.failed else ""
    _phases.setdefault(report.nodeid, []).append((report.when, report.outcome, text))


def pytest_collectreport(report):
    if _reporting() and report.failed:
        _phases.setdefault(report.nodeid or "collect", []).append(
            ("collect", "failed", _short(report)))


def pytest_exception_interact(node, call, report):
    # Called after pytest_runtest_logreport, for every phase that raised (not skips).
    if _reporting() and call.excinfo is not None:
        _classified[(report.nodeid or "collect", report.when)] = classify_exception(
            call.excinfo.value, exercises_dir())


def pytest_sessionfinish(session):
    if not _reporting():
        return
    with open(os.environ[ENV_CHECK_REPORT], "w", encoding="utf-8") as report_file:
        for nodeid, phases in _phases.items():
            entry = {"nodeid": nodeid, "kind": "pass", "message": ""}
            for when, outcome, text in phases:
                if outcome == "failed":
                    found = _classified.get((nodeid, when))
                    entry.update(found or {"kind": "error", "message": text})
                    break
                if outcome == "skipped":
                    entry.update({"kind": "skip", "message": text})
                    break
            report_file.write(json.dumps(entry) + "\n")
