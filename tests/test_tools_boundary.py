"""The textbook does not lean on the tooling: no module of `kvlab` (src/kvlab/) or `kvlab.kernels`
(kernels/) imports `kvlab.tools` (tools/), except inside a function of a `kvlab` subcommand
(src/kvlab/cli/) that hands its work to a tool, so the import happens only when that subcommand
runs. Checked twice: in the source (every import statement, absolute or relative) and by
importing every module and looking for `kvlab.tools` among the modules loaded."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (folder, the package it installs as)
TEXTBOOK = ((ROOT / "src" / "kvlab", "kvlab"), (ROOT / "kernels", "kvlab.kernels"))


def _module_name(path: Path, folder: Path, package: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute module names an import statement names (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _tools_imports() -> list[tuple[str, int, str | None]]:
    """(file, line, the function it sits in or None at module level) of every statement in the
    textbook that imports kvlab.tools or a module under it."""
    found = []
    for folder, package in TEXTBOOK:
        for path in sorted(folder.rglob("*.py")):
            module = _module_name(path, folder, package)
            tree = ast.parse(path.read_text(), str(path))

            def visit(node: ast.AST, function: str | None) -> None:
                for child in ast.iter_child_nodes(node):
                    inside = child.name if isinstance(
                        child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                    names = _imported(child, module, path.name == "__init__.py")
                    if any(name == "kvlab.tools" or name.startswith("kvlab.tools.")
                           for name in names):
                        found.append((path.relative_to(ROOT).as_posix(), child.lineno, function))
                    visit(child, inside)

            visit(tree, None)
    return found


def test_the_resolver_sees_relative_and_absolute_imports_of_the_tools():
    for source, module, is_package in [
            ("from ..tools import machine", "kvlab.cli.size", False),
            ("from .tools.machine import card_slug", "kvlab.report", False),
            ("from . import tools", "kvlab", True),
            ("import kvlab.tools.tour.runner", "kvlab.sizing", False),
            ("from kvlab.tools.vllm_compare import run_comparison", "kvlab.kernels.backend", False)]:
        names = _imported(ast.parse(source).body[0], module, is_package)
        assert any(name.startswith("kvlab.tools") for name in names), (source, names)
    assert not any(name.startswith("kvlab.tools") for name in _imported(
        ast.parse("from ..paged import tools").body[0], "kvlab.cli.size", False))


def test_only_a_subcommands_run_imports_the_tools():
    found = _tools_imports()
    assert found, "the compare-vllm subcommand hands its work to kvlab.tools.vllm_compare"
    for path, line, function in found:
        assert path.startswith("src/kvlab/cli/") and function is not None, \
            f"{path}:{line} imports kvlab.tools outside a kvlab subcommand's function"


def test_importing_every_textbook_module_loads_no_tool():
    modules = [_module_name(path, folder, package)
               for folder, package in TEXTBOOK for path in sorted(folder.rglob("*.py"))
               if path.stem != "__main__"]  # a __main__ runs its command when imported
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.startswith('kvlab.tools')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
