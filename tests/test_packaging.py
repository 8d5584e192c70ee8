"""Packaging: kernels/ installs as kvlab.kernels, environment.yml matches pyproject.toml."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def environment_pip_lines() -> list[str]:
    """The requirement lines under `- pip:` in environment.yml (comments and `-e .` dropped)."""
    lines, in_pip = [], False
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        text = raw.strip()
        if text == "- pip:":
            in_pip = True
            continue
        if in_pip and text.startswith("- ") and not text.startswith("- -e"):
            lines.append(text[2:].split(" #")[0].strip())
    return lines


def test_environment_yml_lists_exactly_the_pyproject_requirements():
    project = pyproject()["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    assert sorted(environment_pip_lines()) == sorted(wanted)


def test_environment_yml_python_matches_requires_python():
    requires = pyproject()["project"]["requires-python"]
    assert f"python{requires}" in (ROOT / "environment.yml").read_text()


def test_kernels_is_a_subpackage_and_no_top_level_kernels_module(tmp_path):
    import kvlab.kernels

    assert Path(kvlab.kernels.__file__).resolve().parent == ROOT / "kernels"
    # The install must not expose our kernels/ folder as a top-level `kernels` module. Ask from a
    # neutral folder: from the repository root, `kernels/` is importable just by being in cwd.
    probe = ("import importlib.util, sys; spec = importlib.util.find_spec('kernels'); "
             "print(spec.origin if spec else '')")
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert not found or Path(found).resolve().parent != ROOT / "kernels", found


def test_wheel_installs_kernels_under_kvlab_and_ships_the_tiny_model(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("kvlab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvlab/kernels/__init__.py" in names
    for package in (ROOT / "src" / "kvlab").rglob("__init__.py"):  # every subpackage ships
        assert f"kvlab/{package.relative_to(ROOT / 'src' / 'kvlab').as_posix()}" in names
    assert not any(name.startswith("kernels/") for name in names)
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        assert f"kvlab/models/tiny/{file}" in names
    for file in ("conversation_trace.jsonl", "synthetic_trace.jsonl", "LICENSE-APACHE",
                 "NOTICE.md"):  # the Mooncake traces ship with their licence and attribution
        assert f"kvlab/traces/data/mooncake/{file}" in names
    # The real traces ship with their attribution (CC BY 4.0 asks for it).
    for file in ("AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv",
                 "README.md", "NOTICE"):
        assert f"kvlab/traces/data/azure-llm-2023/{file}" in names, file
