"""The dry run's fix for Triton 3.6's interpreter under NumPy >= 2.4 (int() of a 1-element array).

Triton 3.6's interpreter converts a run-time loop bound with `int(self.handle.data)`; the Triton
installed here already squeezes first (the upstream fix). The test puts 3.6's conversion back on
top of this Triton's, shows a kernel with `range(0, n)` failing with NumPy's TypeError, and the same
kernel running once `fix_interpreter_index` is applied: what the GPU machine's dry run meets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy
import pytest

pytest.importorskip("triton")

KERNEL = textwrap.dedent("""
    import sys
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    newer = interpreter._patch_lang_tensor

    def as_in_triton_3_6(tensor, scope):  # Triton 3.6.0's __index__: int() of the array itself
        newer(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    interpreter._patch_lang_tensor = as_in_triton_3_6
    if sys.argv[1] == "fixed":
        from kvlab.tools.tour.triton_compat import fix_interpreter_index
        assert fix_interpreter_index()

    @triton.jit
    def count(out_ptr, n):
        total = 0
        for i in range(0, n):  # n is known only at run time: a 1-element array in the interpreter
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    count[(1,)](out, 5)
    print("count", out.item())
""")


def run_kernel(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KERNEL, mode], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)


@pytest.mark.skipif(numpy.lib.NumpyVersion(numpy.__version__) < "2.4.0",
                    reason="NumPy < 2.4 still converts a 1-element array to int")
def test_interpreter_fix_makes_a_run_time_loop_bound_work_again():
    broken = run_kernel("as-in-3.6")
    assert broken.returncode != 0
    assert "only 0-dimensional arrays can be converted to Python scalars" in broken.stderr
    fixed = run_kernel("fixed")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.strip() == "count 5"


def test_launcher_runs_the_module_and_leaves_compiled_runs_alone(tmp_path, monkeypatch):
    from kvlab.tools.tour import triton_compat

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_compat.needs_fix()  # on a GPU (no interpreter) nothing is patched
    module = tmp_path / "say_args.py"
    module.write_text("import sys\nprint('args', sys.argv[1:])\n")
    done = subprocess.run([sys.executable, "-m", "kvlab.tools.tour.triton_compat", "say_args",
                           "--x", "1"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path), TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "args ['--x', '1']"
