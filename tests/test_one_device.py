"""One device for the whole course (COURSE.md, "One device"): no library default and no notebook
cell pins the CPU or a GPU; every model, cache and measurement takes the device from
`kvlab.device.default_device()` (the notebooks through `env = setup()`), which `KVLAB_DEVICE`
overrides, and a bad value is a clear error."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from kvlab.device import default_device, default_dtype, resolve_device

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "src" / "kvlab").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DEVICE_NAMES = {"cpu", "cuda"}


def _names_a_device(node: ast.AST) -> bool:
    """A literal "cpu", "cuda" or "cuda:N", or torch.device(<such a literal>)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] in DEVICE_NAMES
    return (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device"
            and bool(node.args) and _names_a_device(node.args[0]))


def library_pins(tree: ast.AST) -> list[str]:
    """Defaults that choose a device: parameter defaults, argparse defaults, `x or "cpu"`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            found += [f"line {node.lineno}: a parameter of {getattr(node, 'name', 'lambda')} "
                      f"defaults to {ast.unparse(d)}" for d in defaults if _names_a_device(d)]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("add_argument"):
            found += [f"line {node.lineno}: argparse default {ast.unparse(k.value)}"
                      for k in node.keywords if k.arg == "default" and _names_a_device(k.value)]
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            found += [f"line {node.lineno}: falls back to {ast.unparse(v)}"
                      for v in node.values[1:] if _names_a_device(v)]
    return found


def notebook_pins(source: str) -> list[str]:
    """Places a notebook cell chooses a device itself: torch.device("..."), device="...",
    .to("..."), .cuda(). (Comparisons such as `device.type == "cuda"` ask, they do not choose.)"""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        call = ast.unparse(node.func)
        if call == "torch.device" and node.args and _names_a_device(node.args[0]):
            found.append(ast.unparse(node))
        elif call.endswith(".to") and node.args and _names_a_device(node.args[0]):
            found.append(ast.unparse(node))
        elif call.endswith(".cuda"):
            found.append(ast.unparse(node))
        found += [ast.unparse(node) for k in node.keywords
                  if k.arg == "device" and _names_a_device(k.value)]
    return found


def code_of(notebook: Path) -> str:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    lines = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_library_default_pins_a_device(path):
    assert not library_pins(ast.parse(path.read_text(encoding="utf-8"))), path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_notebook_cell_pins_a_device(path):
    assert not notebook_pins(code_of(path)), path.name


def test_the_checks_see_a_pin():
    tree = ast.parse('def f(device="cpu"): pass\np.add_argument("--d", default="cuda")\n'
                     'x = d or "cpu"\ndef g(device=None): pass')
    assert len(library_pins(tree)) == 3
    assert notebook_pins('m.to("cuda:0"); torch.device("cpu"); load(device="cpu"); x.cuda()\n'
                         'if env.device.type == "cuda": y = x.cpu().numpy()') == [
        "m.to('cuda:0')", "torch.device('cpu')", "load(device='cpu')", "x.cuda()"]


# ---- KVLAB_DEVICE ------------------------------------------------------------------------------

@pytest.fixture
def gpu_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_unset_takes_the_gpu_when_there_is_one(monkeypatch, gpu_present):
    monkeypatch.delenv("KVLAB_DEVICE", raising=False)
    assert default_device() == torch.device("cuda:0")


def test_kvlab_device_cpu_keeps_a_gpu_machine_on_the_cpu(monkeypatch, gpu_present):
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    assert default_device() == torch.device("cpu")
    assert default_dtype() is torch.float32
    assert resolve_device(None) == torch.device("cpu") and resolve_device("cuda:1").index == 1


def test_kvlab_device_names_a_card(monkeypatch, gpu_present):
    monkeypatch.setenv("KVLAB_DEVICE", "cuda:1")
    assert default_device() == torch.device("cuda:1")
    monkeypatch.setenv("KVLAB_DEVICE", "cuda:2")
    with pytest.raises(ValueError, match=r"KVLAB_DEVICE=cuda:2: only 2 CUDA device\(s\) here"):
        default_device()


@pytest.mark.parametrize("value", ["tpu", "gpu", "CPU", "cuda:x", "mps"])
def test_any_other_value_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("KVLAB_DEVICE", value)
    with pytest.raises(ValueError, match=rf"KVLAB_DEVICE='{value}': expected cpu, cuda or cuda:N"):
        default_device()


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("KVLAB_DEVICE", "cuda")
    with pytest.raises(ValueError, match="KVLAB_DEVICE=cuda: no CUDA device is visible here"):
        default_device()


def test_models_and_caches_default_to_the_course_device(monkeypatch):
    from kvlab.checkpoint import load_model
    from kvlab.contiguous import ContiguousKVCache
    from kvlab.paged import PagedKVCache

    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    model = load_model("tiny")
    assert next(model.parameters()).device == default_device()
    assert next(model.parameters()).dtype is default_dtype()
    for cache in (ContiguousKVCache(model.config, 1, 8), PagedKVCache(model.config, 2, 4)):
        assert (cache.device, cache.dtype) == (default_device(), default_dtype())


def test_kvlab_device_cpu_gives_the_stored_outputs(tmp_path):
    """On this machine (no GPU) KVLAB_DEVICE=cpu and an unset variable are the same device: a
    notebook re-executed under KVLAB_DEVICE=cpu matches its stored outputs (nbval), as the suite's
    own nbval run checks them with the variable unset. (On a GPU machine the variable keeps every
    cell on the CPU, so the same stored outputs hold there too.)"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVLAB_DEVICE": "cpu"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                          str(ROOT / "notebooks" / "01_a_tiny_llama.ipynb")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
