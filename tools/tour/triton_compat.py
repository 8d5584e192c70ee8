"""Run a module as `python -m` would, with Triton's interpreter fixed for NumPy >= 2.4 first.

    python -m kvlab.tools.tour.triton_compat MODULE [ARGS...]

Under `TRITON_INTERPRET=1` every scalar inside a kernel is a 1-element NumPy array, and Triton 3.6's
interpreter turns one into a Python int (for `range(start, end)`, a loop bound known only at run
time) with `int(array)`. NumPy 2.4 made that a TypeError for arrays of ndim > 0 (deprecated since
1.25; NumPy 2.4.0 release notes), so on a machine with Triton 3.6 and NumPy 2.5 every such kernel
fails in the dry run. Triton fixed it upstream by squeezing the array first (triton-lang/triton
issue 9171); `fix_interpreter_index` applies the same conversion to an older Triton, and does
nothing where it is not needed. The dry run starts each stage through this launcher, so the
course's kernels, whatever loops they use, run in the interpreter there too.
"""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["needs_fix", "fix_interpreter_index", "main"]


def needs_fix() -> bool:
    """True when the interpreter is on and this NumPy refuses int() of a 1-element 1-D array."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import numpy

    try:
        int(numpy.zeros(1, dtype=numpy.int32))
    except TypeError:
        return True
    return False


def _index(tensor) -> int:
    """A scalar kernel value as a Python int: the one element of its 1-element array."""
    return int(tensor.handle.data.reshape(-1)[0]) if tensor.handle.data.size == 1 \
        else int(tensor.handle.data)


def fix_interpreter_index() -> bool:
    """Make the interpreter's `tl.tensor.__index__` take the array's one element; True if done.

    The interpreter sets its patches on `tl.tensor` while a kernel runs, in `_patch_lang_tensor`;
    this wraps that function so its `__index__` is replaced right after (and restored with it).
    """
    if not needs_fix():
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton here: the stages that need it say so themselves
        return False

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "kvlab_fixed", False):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patch_lang_tensor.kvlab_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m kvlab.tools.tour.triton_compat MODULE [ARGS...]")
    if fix_interpreter_index():
        print("gpu tour: Triton's interpreter: int() of a 1-element array fixed for this NumPy",
              flush=True)
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
