"""The tests here grade the `stageN_*.py` files in $KVLAB_EXERCISES_DIR (default: solutions/);
`kvlab check` (kvlab.checker) points it at the learner's folder."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from kvlab.checker import ENV_EXERCISES_DIR

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"


@pytest.fixture(scope="session")
def load_stage():
    """`load_stage("stage0_kv_size.py")`: the learner's module, compiled from its source (never
    from a stale .pyc); a missing file, a syntax error or an error at import raises as it is."""
    folder = Path(os.environ.get(ENV_EXERCISES_DIR) or SOLUTIONS)

    def load(filename: str) -> types.ModuleType:
        path = folder / filename
        module = types.ModuleType(f"learner_{path.stem}")
        module.__file__ = str(path)
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        exec(compile(path.read_text(encoding="utf-8"), path, "exec", dont_inherit=True),
             module.__dict__)
        return module

    return load
