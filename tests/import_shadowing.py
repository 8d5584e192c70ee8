"""What `import name` would find when Python starts in a folder of the repository.

`python`, `python -m pytest` and `python -m kvlab` put the folder they start in first on
`sys.path`; so do `python scripts/x.py` (scripts/), a Jupyter kernel (the notebook's folder) and
pytest itself (tests/, the folder above the `tests/exercises` package). A regular package (a
folder with `__init__.py`) or a module (`x.py`) there wins over an installed one of the same name:
the root's old `kernels/__init__.py` shadowed Hugging Face's `kernels`, which transformers 5
imports, and turned 121 tests red. A folder without `__init__.py` is a namespace portion (PEP 420):
Python takes it only when nothing installed has the name, unless the installed one is itself a
namespace package, which would then be merged with ours. So the check asks Python what it would
import, rather than comparing names alone.

tests/conftest.py runs `check_start_folders()` before it imports torch, so a shadowing folder stops
the suite with its own message rather than a traceback from deep inside torch;
tests/test_import_shadowing.py holds the rule and tests the check itself.
"""

import importlib.machinery
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The folders Python starts in: the root (python, python -m ..., pytest's rootdir), the notebooks'
# folder (a Jupyter kernel's working folder), scripts/ (`python scripts/x.py`) and tests/ (pytest
# prepends the folder above the tests/exercises package).
START_FOLDERS = (ROOT, ROOT / "notebooks", ROOT / "scripts", ROOT / "tests")
EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def importable_names(folder: Path) -> dict[str, Path]:
    """Top-level names a folder on `sys.path` offers: its folders and its modules."""
    names = {}
    for entry in folder.iterdir():
        if entry.name.startswith((".", "__")):
            continue
        if entry.is_dir():
            name = entry.name
        elif entry.suffix == ".py" or entry.name.endswith(EXTENSION_SUFFIXES):
            name = entry.name.split(".")[0]
        else:
            continue
        if name.isidentifier():
            names[name] = entry
    return names


def in_repository(place: str, root: Path) -> bool:
    """Whether a path lies in the repository, a venv made inside it (`.venv/`) excepted."""
    path = Path(place or ".").resolve()
    return path.is_relative_to(root) and not path.is_relative_to(Path(sys.prefix).resolve())


def outside(root: Path) -> list[str]:
    """This interpreter's `sys.path` without the entries in the repository (pytest adds some)."""
    return [entry for entry in sys.path if not in_repository(entry, root)]


def shadowing(folder: Path, root: Path = ROOT) -> list[str]:
    """One line for each installed top-level module that `import name`, run with `folder` first
    on `sys.path`, would take (wholly or in part) from inside `root`."""
    installed = importlib.metadata.packages_distributions()
    problems = []
    for name, entry in sorted(importable_names(folder).items()):
        if name not in installed:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, [str(folder), *outside(root)])
        found = [spec.origin] if spec and spec.origin else []
        found += list(spec.submodule_search_locations or []) if spec else []
        ours = [place for place in found if in_repository(place, root)]
        if ours:
            kind = ("a regular package" if (entry / "__init__.py").exists() else
                    "a namespace folder merged into the installed namespace package"
                    if entry.is_dir() else "a module")
            problems.append(
                f"{entry.relative_to(root)} ({kind}) is what `import {name}` finds when Python "
                f"starts in {folder.relative_to(root).as_posix() or '.'}/, in place of `{name}` "
                f"from the installed distribution {' and '.join(sorted(set(installed[name])))}")
    return problems


def check_start_folders() -> None:
    """Raise with one line per shadowing import, if any folder Python starts in has one."""
    problems = [line for folder in START_FOLDERS for line in shadowing(folder)]
    if problems:
        raise RuntimeError("a folder of the repository shadows an installed package:\n  "
                           + "\n  ".join(problems))

