"""The tests here grade the `stageN_*.py` in $KVLAB_EXERCISES_DIR, set by `kvlab check`.

They also run from the installed package (`kvlab.exercise_tests`), where tests/conftest.py is not
there, and `kvlab check` leaves it out in every install: what they need is set up here.
"""

import os
import runpy
import types
from pathlib import Path

import pytest
import torch  # does not import Triton

from kvlab.tools.checker import ENV_EXERCISES_DIR

# Stage 5's kernels run in Triton's CPU interpreter without a GPU; it is read when Triton is first
# imported, so it is set before test_stage5.py imports it. One thread: the tensors are tiny.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def load_stage():
    """`load_stage("stage0_kv_size.py")`: the module, from $KVLAB_EXERCISES_DIR or the checkout's
    solutions/, run from its source (never a stale .pyc); a missing file or an error at import
    raises as it is."""
    folder = Path(os.environ.get(ENV_EXERCISES_DIR) or Path(__file__).parents[2] / "solutions")
    return lambda filename: types.SimpleNamespace(**runpy.run_path(str(folder / filename)))
