"""Packaging: every module the course imports is declared, environment.yml matches pyproject.toml,
kernels/ installs as kvlab.kernels, tools/ as kvlab.tools and tests/exercises/ as
kvlab.exercise_tests (so `kvlab check` grades from a plain, non-editable install)."""

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Declared though nothing imports them by name, and why.
USED_WITHOUT_IMPORT = {
    "accelerate": "transformers needs it to load a GGUF file (test_gguf_loader.py, test_smollm2.py)",
    "nbval": "the pytest plugin that re-executes the notebooks (pyproject's addopts: --nbval)",
}

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


def distribution(requirement: str) -> str:
    """The normalised distribution name (PEP 503) of a requirement such as "Jinja2>=3.1"."""
    return normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group())


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[set[str], set[str]]:
    """(distributions in [project.dependencies], those in the [test] extra)."""
    project = pyproject()["project"]
    return ({distribution(line) for line in project["dependencies"]},
            {distribution(line) for line in project["optional-dependencies"]["test"]})


def imported_modules(source: str, optional: bool = True) -> set[str]:
    """Top-level names a Python source imports: import statements (not relative ones) and
    `pytest.importorskip("name")` / `importlib.import_module("name")` with a literal name.
    optional=False leaves out the imports tried under `except ImportError` (the code runs on
    without them)."""
    tree, names, tried = ast.parse(source), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                name in ast.unparse(handler.type or ast.Name("")) for handler in node.handlers
                for name in ("ImportError", "ModuleNotFoundError")):
            tried.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    for node in ast.walk(tree):
        if not optional and id(node) in tried:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("importorskip", "import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return {name.split(".")[0] for name in names}


def notebook_code(path: Path) -> str:
    """A notebook's code cells as one Python source, IPython's %magic and !shell lines left out."""
    cells = [cell["source"] for cell in json.loads(path.read_text())["cells"]
             if cell["cell_type"] == "code"]
    lines = "\n".join("".join(cell) for cell in cells).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def third_party_imports(*folders: str, optional: bool = True) -> dict[str, set[str]]:
    """{distribution: the files that import it} for the .py files and notebooks under `folders`
    (optional=False: leaving out the imports tried under `except ImportError`).

    A module maps to its distribution through importlib.metadata.packages_distributions(); one
    not installed here (triton off Linux, tomli on 3.11+) is taken to share its name."""
    local = {"kvlab"} | {path.stem for path in ROOT.glob("tests/**/*.py")} \
        | {path.stem for path in ROOT.glob("scripts/*.py")}
    owners = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".ipynb"):
                continue
            source = notebook_code(path) if path.suffix == ".ipynb" else path.read_text()
            modules = imported_modules(source, optional) - local - set(sys.stdlib_module_names)
            for module in modules:
                for name in owners.get(module, [module]):
                    found.setdefault(normalise(name), set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_the_course_imports_is_declared():
    """What kvlab, its kernels and tools, the exercise checks (which `kvlab check` runs from any
    install) and the notebooks import unconditionally is a dependency; what the tests and scripts
    import is at least in [test]. A module the machine happens to hold must not keep CI green."""
    runtime, test = declared()
    used = third_party_imports("src", "kernels", "tools", "tests/exercises", "notebooks",
                               optional=False)
    missing = {name: sorted(files)[:3] for name, files in used.items() if name not in runtime}
    assert not missing, f"imported but not in [project.dependencies]: {missing}"
    used = third_party_imports("tests", "scripts")
    missing = {name: sorted(files)[:3] for name, files in used.items()
               if name not in runtime | test}
    assert not missing, f"imported but declared nowhere (pyproject [test]?): {missing}"


def test_every_declared_distribution_is_used():
    runtime, test = declared()
    used = set(third_party_imports("src", "kernels", "tools", "tests", "scripts", "notebooks"))
    assert sorted((runtime | test) - used) == sorted(USED_WITHOUT_IMPORT), \
        "declared but imported nowhere: import it, drop it, or say why in USED_WITHOUT_IMPORT"


def test_environment_yml_lists_exactly_the_pyproject_requirements():
    project = pyproject()["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    assert sorted(environment_pip_lines()) == sorted(wanted)


def test_environment_yml_python_matches_requires_python():
    requires = pyproject()["project"]["requires-python"]
    assert f"python{requires}" in (ROOT / "environment.yml").read_text()


@pytest.mark.parametrize("folder", ["kernels", "tools"])
def test_kernels_and_tools_are_subpackages_and_no_top_level_modules(folder, tmp_path):
    import importlib

    importlib.import_module(f"kvlab.{folder}")
    # The install must not expose our kernels/ or tools/ folder as a top-level module. Ask from a
    # neutral folder; from the root, tests/test_import_shadowing.py holds the rule.
    probe = (f"import importlib.util; spec = importlib.util.find_spec({folder!r}); "
             "print(*[spec.origin, *(spec.submodule_search_locations or [])] if spec else [])")
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.split()
    assert not any(Path(place).resolve().is_relative_to(ROOT / folder) for place in found), found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """kvlab's wheel, built from this checkout (its dependencies are this venv's)."""
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(folder), str(ROOT)], check=True, capture_output=True)
    return next(folder.glob("kvlab-*.whl"))


def test_wheel_installs_kernels_under_kvlab_and_ships_the_tiny_model(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for module in (ROOT / "kernels").glob("*.py"):  # a namespace package: no __init__.py
        assert f"kvlab/kernels/{module.name}" in names
    for check in ROOT.glob("tests/exercises/*.py"):  # `kvlab check` grades from any install
        assert f"kvlab/exercise_tests/{check.name}" in names
    for package in (ROOT / "src" / "kvlab").rglob("__init__.py"):  # every subpackage ships
        assert f"kvlab/{package.relative_to(ROOT / 'src' / 'kvlab').as_posix()}" in names
    for module in (ROOT / "tools").rglob("*.py"):  # every tool ships, as kvlab.tools
        assert f"kvlab/tools/{module.relative_to(ROOT / 'tools').as_posix()}" in names
    assert not any(name.startswith(("kernels/", "tools/")) for name in names)
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        assert f"kvlab/models/tiny/{file}" in names
    for file in ("conversation_trace.jsonl", "synthetic_trace.jsonl", "LICENSE-APACHE",
                 "NOTICE.md"):  # the Mooncake traces ship with their licence and attribution
        assert f"kvlab/traces/data/mooncake/{file}" in names
    # The real traces ship with their attribution (CC BY 4.0 asks for it).
    for file in ("AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv",
                 "README.md", "NOTICE"):
        assert f"kvlab/traces/data/azure-llm-2023/{file}" in names, file
    assert "kvlab/calibration/calibration.json" in names  # the calibrated clock's measurements and fit


def test_checker_grades_from_a_non_editable_install(wheel, tmp_path):
    """`pip install .` (Colab's first cell) puts no checkout behind kvlab: `kvlab check` runs the
    installed kvlab.exercise_tests and finds exercises/ from the current folder up."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    course = tmp_path / "course"  # a learner's folder: exercises/, solutions/, notebooks/
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_exercises.py"), "--out",
                    str(course / "exercises")], check=True, capture_output=True)
    (course / "solutions").mkdir()
    (course / "solutions" / "stage0_kv_size.py").write_text(
        (ROOT / "solutions" / "stage0_kv_size.py").read_text())
    (course / "notebooks").mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the editable install of this venv

    def kvlab(*args: str, cwd: Path = course / "notebooks") -> tuple[int, str]:
        run = subprocess.run([sys.executable, "-m", "kvlab", *args], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=600)
        return run.returncode, run.stdout + run.stderr

    probe = "import kvlab.tools.checker as c; print(c.exercise_tests_dir())"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert Path(where) == site / "kvlab" / "exercise_tests"
    code, output = kvlab("check", "0", "--target", "solutions")
    assert code == 0 and output.startswith("Stage 0: PASS ("), output
    code, output = kvlab("check", "0")
    assert code == 1 and output.startswith("Stage 0: NOT YET (0 of ") and "  TODO  " in output
    code, output = kvlab("check", "0", cwd=tmp_path)  # no exercises/ here or above, no checkout
    assert code == 2 and output.count("\n") == 1 and "no exercises/ folder" in output, output
