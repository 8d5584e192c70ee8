"""`kvlab serve` as a newcomer meets it: a request rejected at any place in the trace, long work on a
terminal, and a `--trace` that is not a trace, said the same way by every command that takes one."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys

import pytest
from cli_run import run

MAX_MODEL_LEN = 64
POSITIONS = {  # which of 5 requests are longer than max_model_len, and so rejected
    "first": {0}, "middle": {2}, "last": {4}, "every": {0, 1, 2, 3, 4}, "only": {0},
}


def write_trace(folder, rejected: set[int], num_requests: int) -> str:
    """An Azure-format trace: prompts of 20-28 tokens, 4 output tokens, a request every 2 s (each
    done before the next arrives, so a rejected one arrives to an idle server); the `rejected`
    ones have a 100-token prompt (> max_model_len 64)."""
    rows = [f"2023-11-16 18:15:{10 + 2 * i}.0000000,{100 if i in rejected else 20 + 2 * i},4"
            for i in range(num_requests)]
    path = folder / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return str(path)


MODES = {
    "sim": ["--simulate", "--model", "llama-3.1-8b", "--gpu", "L4", "--kv-budget", "1"],
    "model": ["--model", "tiny", "--kv-budget", "0.001"],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_a_rejected_request_anywhere_ends_the_run_and_loses_no_other(tmp_path, capsys, position,
                                                                      mode):
    rejected = POSITIONS[position]
    num_requests = 1 if position == "only" else 5
    trace = write_trace(tmp_path, rejected, num_requests)
    flags = ["serve", "--trace", trace, "--max-model-len", str(MAX_MODEL_LEN), *MODES[mode]]
    code, out, err = run(capsys, *flags, "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [row["strategy"] for row in rows] == ["contiguous", "paged", "paged+prefix"]
    for row in rows:
        assert (row["requests"], row["finished"], row["rejected"]) == \
            (num_requests, num_requests - len(rejected), len(rejected)), row
    # The table says so too, and names one rejected request and why.
    code, out, err = run(capsys, *flags)
    assert code == 0, err
    table = [line.split() for line in out.splitlines()
             if line.split()[:1] in (["contiguous"], ["paged"], ["paged+prefix"])]
    assert [(cells[1], cells[2]) for cells in table] == \
        [(str(num_requests - len(rejected)), str(len(rejected)))] * 3
    first = min(rejected)
    assert f"rejected, e.g. request {first}: 100 prompt + 4 output = 104 tokens > " \
           f"max_model_len={MAX_MODEL_LEN}" in out


def _serve_on_a_terminal(tmp_path, *flags: str, columns: int) -> tuple[int, str, str]:
    """`kvlab serve` with stderr on a pseudo-terminal of `columns` columns: (status, stdout, what
    the terminal showed)."""
    import fcntl
    import struct
    import termios

    trace = write_trace(tmp_path, set(), 5)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "kvlab", "serve", "--trace", trace, "--simulate", "--model",
         "llama-3.1-8b", "--gpu", "L4", "--kv-budget", "1", *flags],
        stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    shown = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the command has ended
            break
        if not chunk:
            break
        shown += chunk
    stdout = process.communicate(timeout=120)[0]
    os.close(leader)
    return process.returncode, stdout, shown.decode(errors="replace")


@pytest.mark.skipif(not hasattr(pty, "openpty") or sys.platform == "win32",
                    reason="needs a POSIX pseudo-terminal")
@pytest.mark.parametrize("columns", [100, 0])  # 0: a terminal nobody sized (an IDE's, a harness's)
def test_long_work_shows_a_bar_per_strategy_on_a_terminal_only(tmp_path, columns):
    code, stdout, shown = _serve_on_a_terminal(tmp_path, columns=columns)
    assert code == 0
    for strategy in ("contiguous", "paged", "paged+prefix"):
        assert f"{strategy}:" in shown and "req" in shown, shown  # tqdm's "paged:  0%| | 0/5 req"
    assert "req/s" not in stdout and "%|" not in stdout  # the table on stdout stays clean
    code, stdout, shown = _serve_on_a_terminal(tmp_path, "--json", columns=columns)
    assert code == 0 and shown == ""  # --json: nothing but the JSON
    json.loads(stdout)


@pytest.mark.parametrize("command", [["report"], ["serve", "--simulate"]])
@pytest.mark.parametrize("mistake, message", [
    ("folder", "is a folder, not a trace file"),
    ("missing.csv", "no such file, and not a shipped trace"),
    ("notes.txt", "unknown trace format .txt"),
])
def test_every_command_that_takes_a_trace_says_one_mistake_one_way(tmp_path, capsys, command,
                                                                   mistake, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("not a trace\n")
    code, out, err = run(capsys, *command, "--trace", str(tmp_path / mistake))
    assert code == 2 and out == ""
    prefix = f"kvlab {command[0]}: error: {tmp_path / mistake}: {message}; expected a shipped " \
             f"trace (azure-conv, azure-code, mooncake-conversation, mooncake-synthetic) or a " \
             f"trace file: .csv (Azure: TIMESTAMP,ContextTokens,GeneratedTokens) or .jsonl"
    assert err.startswith(prefix) and err.count("\n") == 1, err
