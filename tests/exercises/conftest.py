"""The tests here grade the `stageN_*.py` in $KVLAB_EXERCISES_DIR, set by `kvlab check`."""

import os
import runpy
import types
from pathlib import Path

import pytest

from kvlab.checker import ENV_EXERCISES_DIR, ROOT


@pytest.fixture(scope="session")
def load_stage():
    """`load_stage("stage0_kv_size.py")`: the module, from $KVLAB_EXERCISES_DIR or solutions/, run
    from its source (never a stale .pyc); a missing file or an error at import raises as it is."""
    folder = Path(os.environ.get(ENV_EXERCISES_DIR) or ROOT / "solutions")
    return lambda filename: types.SimpleNamespace(**runpy.run_path(str(folder / filename)))
