"""workshop-constraints.txt, the known-good versions an instructor installs for a workshop: pip
resolves kvlab's requirements under it to exactly the versions it pins, every one of them used.

The README's default install takes the newest releases (as a learner's does, and as CI's does, so
the next break shows early); this file is the tested fallback (docs/instructor_notes.md). The check
asks pip to resolve without installing (`--dry-run --ignore-installed --report`), so it needs the
package index, as the install itself does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "workshop-constraints.txt"
# The versions .ci/run prints at its start: the ones whose newest releases have broken a fresh
# machine before, or would.
WATCHED = ("torch", "triton", "transformers", "kernels", "nbval", "jupyterlab")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares it (Jinja2, jinja2 and jinja_2 alike)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pin_lines() -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line, comments and blank lines left out."""
    pinned = []
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.!+]+)", line)
            assert match, f"{line!r}: a workshop pins one version, name==version"
            pinned.append((normalise(match[1]), match[2]))
    return pinned


def test_the_file_pins_the_watched_packages_once_each():
    names = [name for name, _ in pin_lines()]
    assert len(names) == len(set(names)), "a package pinned twice"
    assert set(WATCHED) <= set(names)


def test_pip_resolves_the_course_to_exactly_the_pinned_versions(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    report = tmp_path / "report.json"
    resolve = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
         "--report", str(report), "-c", str(CONSTRAINTS), *requirements],
        capture_output=True, text=True, timeout=900)
    assert resolve.returncode == 0, re.sub(r"WARNING: Location .*\n", "", resolve.stderr)[-3000:]
    resolved = {normalise(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    pinned = dict(pin_lines())
    # A local build label (torch's +cpu) is the index's choice of build, not another version.
    differs = {name: (version, pinned.get(name)) for name, version in resolved.items()
               if version.split("+")[0] != pinned.get(name)}
    assert not differs, f"resolved vs pinned: {differs}"
    unused = sorted(set(pinned) - set(resolved))
    assert not unused, f"pinned but not installed by the course: {unused}"
