"""One stage's process under a hard time limit, and the watchdog that holds the tour to its budget.

A stage may print nothing for minutes (a silent `torch.compile`, a hang in a driver call), so its
limit cannot be checked when a line arrives: a reader thread copies the output while the tour
waits on the process itself, with a timeout. Each stage runs in its own process group (same
session, so whoever kills the tour's session kills the stages too), and a stage past its limit is
killed with everything it started (pytest workers, compile workers).

The watchdog is a timer over the whole tour: at the budget it kills the stage then running; if the
tour has still not finished a grace period later (stuck outside any stage), it ends the process.
The summary is written after every stage, so even that exit leaves the figures made so far.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["StageProcess", "run_with_limit", "Watchdog", "WATCHDOG_EXIT", "WATCHDOG_GRACE_S"]

WATCHDOG_EXIT = 3  # the exit status when the watchdog had to end the tour itself
WATCHDOG_GRACE_S = 10  # after the budget, before the watchdog ends a tour that is stuck


def _group_kwargs() -> dict:
    """Popen arguments that put the child in a new process group of the current session."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


class StageProcess:
    """A running stage: its Popen and a kill() that takes its whole process group down."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace",
                                        **_group_kwargs())
        self.killed_by: str | None = None

    def kill(self, reason: str) -> None:
        """SIGKILL the process group (the stage and all it started); reason goes in its status."""
        if self.process.poll() is not None:
            return
        self.killed_by = self.killed_by or reason
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _copy_lines(stream, log, prefix: str) -> None:
    try:
        for line in stream:
            log.write(line)
            log.flush()
            print(f"{prefix}{line.rstrip()}"[:200], flush=True)
    except ValueError:  # the log was closed: the stage is over, its last lines are dropped
        pass


def run_with_limit(command: list[str], cwd: Path, env: dict[str, str], log_path: Path,
                   limit_s: float, prefix: str = "",
                   started: Callable[[StageProcess], None] | None = None) -> tuple[int | None, str]:
    """Run `command`, its output into log_path (and stdout, each line after `prefix`).

    Returns (exit status, '') when it ended by itself; (None, reason) when it was killed: at
    limit_s seconds, whether or not it printed anything, or by whoever `started` handed it to.
    """
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        stage = StageProcess(command, cwd, env)
        if started is not None:
            started(stage)
        reader = threading.Thread(target=_copy_lines, args=(stage.process.stdout, log, prefix),
                                  daemon=True)
        reader.start()
        try:
            code = stage.process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stage.kill(f"timed out after {limit_s:.0f} s")
            code = stage.process.wait()
        except BaseException:  # the tour itself is interrupted: the stage goes down with it
            stage.kill("interrupted")
            stage.process.wait()
            raise
        else:  # what the stage left running (compile workers) must not hold the next stage's GPU
            try:
                os.killpg(stage.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=5)  # a grandchild that kept the pipe open must not hold the tour
    if stage.killed_by is not None:
        return None, stage.killed_by
    return code, ""


class Watchdog:
    """A timer over the whole tour. At `budget_s` it calls on_budget() (the tour kills its
    running stage there); `grace_s` later, if stop() was not called, it prints why and ends the
    process with WATCHDOG_EXIT."""

    def __init__(self, budget_s: float, on_budget: Callable[[], None],
                 grace_s: float = WATCHDOG_GRACE_S) -> None:
        self.deadline = time.monotonic() + budget_s
        self._on_budget, self._grace_s = on_budget, grace_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        if self._stopped.wait(max(0.0, self.left_s())):
            return
        self._on_budget()
        if self._stopped.wait(self._grace_s):
            return
        print(f"gpu tour: watchdog: still running {self._grace_s:.0f} s past the budget; "
              f"ending the tour (the summary written after the last stage stands)", flush=True)
        os._exit(WATCHDOG_EXIT)
