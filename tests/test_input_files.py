"""Every file a user passes to `kvlab` (trace, config.json, checkpoint folder) that cannot be used
gives one line on stderr naming the file and what was expected, exit status 2, and no traceback."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from kvlab.checkpoint import TINY_MODEL_DIR
from kvlab.cli import main
from kvlab.input_files import InputFileError, MissingInputFileError, read_text

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def fails_cleanly(capsys, argv: list[str], path, *fragments: str) -> str:
    """Run `kvlab argv`: exit 2, nothing on stdout, one stderr line naming `path` and fragments."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvlab {argv[0]}: error: "), err
    assert str(path) in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err
    return err


def unreadable(monkeypatch, path) -> None:
    """Make `path` raise PermissionError when read, as chmod 000 does for a non-root user (the
    tests may run as root, for whom chmod does not stop reading)."""
    real = pathlib.Path.read_bytes

    def read_bytes(self):
        if self == pathlib.Path(path):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)


# ---- the trace (kvlab report --trace) ----------------------------------------------------------

TRACE_CASES = {
    "directory": (None, "is a folder"),
    "empty": (b"", "is empty"),
    "blank": (b"\n \n", "is empty"),
    "header only": (HEADER.encode(), "has a header but no requests"),
    "short row": ((HEADER + "t,5,6\nt,7\n").encode(), "2 of the header's 3 fields"),
    "binary": (b"PK\x03\x04\x00\x00\x08\x00binary zip", "is a binary file"),
    "not utf-8": (b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\xfe,1,2\n", "not UTF-8"),
    "wrong header": (b"time,prompt,output\nt,1,2\n", "header lacks ContextTokens, GeneratedTokens"),
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_bad_trace_files(capsys, tmp_path, case):
    content, problem = TRACE_CASES[case]
    path = tmp_path / "trace.csv"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    err = fails_cleanly(capsys, ["report", "--trace", str(path)], path, problem)
    if case == "short row":
        assert f"{path}:3:" in err  # the line of the bad row
    elif case == "directory":  # what any --trace should be (kvlab.traces.shipped.trace_file)
        assert "expected a shipped trace (azure-conv" in err and ".jsonl (Mooncake" in err
    elif case != "wrong header":
        assert "expected a CSV trace with header TIMESTAMP,ContextTokens,GeneratedTokens" in err


def test_unreadable_trace(capsys, tmp_path, monkeypatch):
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + "t,5,6\n")
    unreadable(monkeypatch, path)
    fails_cleanly(capsys, ["report", "--trace", str(path)], path, "permission denied",
                  "expected a CSV trace")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads files whatever their mode")
def test_unreadable_trace_by_mode(capsys, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + "t,5,6\n")
    path.chmod(0)
    fails_cleanly(capsys, ["report", "--trace", str(path)], path, "permission denied")


def test_missing_trace(capsys, tmp_path):
    path = tmp_path / "absent.csv"
    fails_cleanly(capsys, ["report", "--trace", str(path)], path, "no such file")


# ---- config.json (kvlab size / kvlab report --model) -------------------------------------------

CONFIG_CASES = {
    "empty": (b"", "is empty"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "is a binary file"),
    "not json": (b"hidden_size: 64\n", "not valid JSON"),
    "json list": (b"[1, 2]", "holds a JSON list"),
    "wrong type": (b'{"vocab_size": 10, "hidden_size": "64", "intermediate_size": 8, '
                   b'"num_hidden_layers": 1, "num_attention_heads": 4}', "wrong type"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
@pytest.mark.parametrize("command", ["size", "report"])
def test_bad_config_json(capsys, tmp_path, case, command):
    content, problem = CONFIG_CASES[case]
    path = tmp_path / "config.json"
    path.write_bytes(content)
    argv = ["size", str(path)] if command == "size" else ["report", "--model", str(path)]
    fails_cleanly(capsys, argv, path, problem, "expected a Hugging Face config.json")


def test_config_folder_without_config_json(capsys, tmp_path):
    fails_cleanly(capsys, ["size", str(tmp_path)], tmp_path, "no config.json",
                  "expected a Hugging Face config.json")


def test_unreadable_config_json(capsys, tmp_path, monkeypatch, write_config):
    path = write_config(tmp_path)
    unreadable(monkeypatch, path)
    fails_cleanly(capsys, ["size", str(path)], path, "permission denied")


# ---- the checkpoint folder (kvlab generate --model) --------------------------------------------

@pytest.fixture
def tiny_copy(tmp_path) -> pathlib.Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(TINY_MODEL_DIR, folder)
    return folder


def generate(model) -> list[str]:
    return ["generate", "--model", str(model), "--prompt", "The", "--max-new-tokens", "1"]


def test_size_preset_is_not_a_checkpoint(capsys):
    err = fails_cleanly(capsys, generate("llama-3.1-8b"), "llama-3.1-8b", "size preset",
                        "kvlab size")
    assert "--model tiny" in err


def test_checkpoint_folder_problems(capsys, tmp_path, tiny_copy):
    fails_cleanly(capsys, generate(tmp_path / "none"), tmp_path / "none", "no such folder",
                  "expected a checkpoint folder")
    fails_cleanly(capsys, generate(tiny_copy / "config.json"), tiny_copy / "config.json",
                  "is a file, not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    fails_cleanly(capsys, generate(empty), empty, "no config.json")


def test_checkpoint_files_that_cannot_be_read(capsys, tiny_copy):
    tokenizer = tiny_copy / "tokenizer.json"
    tokenizer.write_text('{"not": "a tokenizer"}')
    fails_cleanly(capsys, generate(tiny_copy), tokenizer, "cannot be read as a tokenizer")
    tokenizer.write_bytes(b"\x00\x01")
    fails_cleanly(capsys, generate(tiny_copy), tokenizer, "is a binary file")

    weights = tiny_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    fails_cleanly(capsys, generate(tiny_copy), weights, "cannot be read as safetensors")
    weights.unlink()
    fails_cleanly(capsys, generate(tiny_copy), tiny_copy, "no *.safetensors")

    (tiny_copy / "config.json").write_text("{")
    fails_cleanly(capsys, generate(tiny_copy), tiny_copy / "config.json", "not valid JSON")


def test_unreadable_checkpoint_config(capsys, tiny_copy, monkeypatch):
    unreadable(monkeypatch, tiny_copy / "config.json")
    fails_cleanly(capsys, generate(tiny_copy), tiny_copy / "config.json", "permission denied")


# ---- the reader itself, and python -m kvlab ----------------------------------------------------

def test_read_text_errors_are_value_errors_and_missing_is_file_not_found(tmp_path):
    with pytest.raises(MissingInputFileError) as info:
        read_text(tmp_path / "nope", "a thing")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    with pytest.raises(InputFileError, match="is a folder.*expected a thing"):
        read_text(tmp_path, "a thing")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello")
    assert read_text(tmp_path / "bom.txt", "text") == "hello"


def test_python_dash_m_kvlab_runs_the_cli(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvlab", "size", "llama-3.1-8b", "--gpu",
                           "H100-80GB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "131,072 B (128 KiB)" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "kvlab", "report", "--trace", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        f"kvlab report: error: {tmp_path}: is a folder, not a trace file; expected a shipped trace "
        f"(azure-conv, azure-code, mooncake-conversation, mooncake-synthetic) or a trace file: "
        f".csv (Azure: TIMESTAMP,ContextTokens,GeneratedTokens) or .jsonl (Mooncake: one JSON "
        f"request per line)")


def test_huge_file_is_refused_before_reading(tmp_path, monkeypatch):
    from kvlab import input_files

    path = tmp_path / "trace.csv"
    path.write_text(HEADER + "t,5,6\n")
    monkeypatch.setattr(input_files, "MAX_TEXT_BYTES", 10)
    with pytest.raises(InputFileError, match=r"too large.*at most 10 B"):
        read_text(path, "a trace")
