"""No folder of the repository may shadow an installed package when Python starts in it
(tests/import_shadowing.py says how Python finds a name, and why the check asks it)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from import_shadowing import ROOT, START_FOLDERS, importable_names, in_repository, shadowing


@pytest.mark.parametrize("folder", START_FOLDERS, ids=lambda f: f.relative_to(ROOT).as_posix() or ".")
def test_no_folder_python_starts_in_shadows_an_installed_package(folder):
    assert not shadowing(folder), "\n".join(shadowing(folder))


def test_the_root_holds_no_regular_package_and_no_module():
    """Stronger than the check above, and independent of what is installed: a learner's venv may
    hold a distribution ours does not (a `tools` package, say). So the root offers Python nothing
    it would take before an installed package: `kernels/` and `tools/` install as `kvlab.kernels`
    and `kvlab.tools` and have no `__init__.py` (kernels/README.md says why)."""
    offered = [entry.name for entry in importable_names(ROOT).values()
               if (entry / "__init__.py").exists() or entry.is_file()]
    assert not offered, f"regular packages or modules at the repository root: {offered}"


def test_kvlab_kernels_and_tools_are_the_repository_folders():
    import kvlab.kernels.paged_attention
    import kvlab.tools.machine

    assert Path(kvlab.kernels.paged_attention.__file__).resolve().parent == ROOT / "kernels"
    assert Path(kvlab.tools.machine.__file__).resolve().parent == ROOT / "tools"


@pytest.mark.parametrize("layout, reported", [
    ({"numpy/__init__.py": ""}, "numpy (a regular package)"),
    ({"transformers/__init__.py": ""}, "transformers (a regular package)"),
    ({"numpy.py": ""}, "numpy.py (a module)"),
    ({"numpy/readme.txt": ""}, None),  # a namespace folder: the installed numpy wins
    ({"not_installed_anywhere/__init__.py": ""}, None),
])
def test_the_check_names_what_collides_with_what(tmp_path, layout, reported):
    """The check itself, on a folder of its own: what it reports, and that it reports only what
    really shadows (try it on the repository: add a `numpy/__init__.py` at the root)."""
    for name, text in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    problems = shadowing(tmp_path, root=tmp_path)
    if reported is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(reported), problems
        assert "installed distribution" in problems[0]


def test_python_started_in_the_root_imports_transformers_and_its_kernels():
    """The failure that started this, run the way the README runs Python."""
    for distribution in ("transformers", "kernels"):  # kernels: a dependency of transformers 5
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{distribution} is not installed")
    probe = ("import kernels, transformers, kvlab.kernels.paged_attention as ours; "
             "from transformers import LlamaForCausalLM; "
             "print(kernels.__file__); print(ours.__file__)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs, ours = run.stdout.split()
    assert not in_repository(theirs, ROOT), theirs
    assert Path(ours).resolve().parent == ROOT / "kernels"
