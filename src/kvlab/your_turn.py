"""Your-turn cells: a piece of the stage the learner writes on the page, checked where it stands.

A notebook leaves a small function for the learner (its body `raise NotImplementedError`, a
comment saying what to write) and passes it here with the library's version and a few inputs.
Not written yet: the page says so and carries on with the library's version, so every later cell
still runs (and the committed outputs are those of the unwritten state). Written: it must give
the library's results on every input, or the cell fails with the input and both answers. The
pattern is Triton-Puzzles' and *LLMs from Scratch*'s exercises, moved onto the page: the learner
writes the line before reading on, and the check answers at once.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Sequence

import torch

__all__ = ["your_turn"]


def _same(yours: Any, library: Any, atol: float, rtol: float) -> bool:
    if isinstance(library, torch.Tensor):
        if not isinstance(yours, torch.Tensor) or yours.shape != library.shape:
            return False
        return bool(torch.allclose(yours.to(library.dtype), library, atol=atol, rtol=rtol,
                                   equal_nan=True))
    if isinstance(library, (tuple, list)):
        return (isinstance(yours, (tuple, list)) and len(yours) == len(library)
                and all(_same(a, b, atol, rtol) for a, b in zip(yours, library)))
    if isinstance(library, numbers.Integral) and not isinstance(library, bool):
        # A count of bytes, blocks or slots is a whole number: 327680.0 would leak into every
        # figure printed from it, so a float that equals it is still wrong.
        return (isinstance(yours, numbers.Integral) and not isinstance(yours, bool)
                and yours == library)
    if isinstance(library, float) and isinstance(yours, numbers.Real):
        # The same sum in another order differs in its last bits: that is not a wrong answer.
        return math.isclose(yours, library, rel_tol=max(rtol, 1e-12), abs_tol=atol)
    return yours == library


def _difference(yours: Any, library: Any, atol: float, rtol: float) -> str:
    """Where two tensors differ, in one line: their shapes, or the first differing element."""
    if not (isinstance(yours, torch.Tensor) and isinstance(library, torch.Tensor)):
        return ""
    if yours.shape != library.shape:
        return f"\nshapes: yours {tuple(yours.shape)}, kvlab's {tuple(library.shape)}"
    yours_d, library_d = yours.double(), library.double()
    differs = ~torch.isclose(yours_d, library_d, rtol=rtol, atol=atol, equal_nan=True)
    if not differs.any():
        return ""
    first = tuple(differs.nonzero()[0].tolist())
    largest = (yours_d - library_d).abs().nan_to_num(float("inf")).max().item()
    return (f"\nfirst difference at index {first}: yours {yours_d[first].item():.6g}, kvlab's "
            f"{library_d[first].item():.6g}; largest |difference| {largest:.3g}")


def _shown(value: Any) -> str:
    """A value for the error message: small tensors in full (floats to 4 decimals), bytes in hex,
    a float that should have been an int marked as such, a long object by its name or first
    field."""
    if isinstance(value, torch.Tensor):
        if value.numel() > 32:
            return f"tensor of shape {tuple(value.shape)}, {value.dtype}"
        if value.is_floating_point():
            return repr(torch.round(value.double(), decimals=4).tolist())
        return repr(value.tolist())
    if isinstance(value, (bytes, bytearray)):
        return f"bytes {value.hex()}" if len(value) <= 32 else f"bytes {value[:32].hex()}..."
    if isinstance(value, float) and value.is_integer():
        return f"{value!r} (a float)"
    text = repr(value)
    if len(text) <= 100:
        return text
    if isinstance(value, (list, tuple)):  # each element shortened on its own
        inner = ", ".join(map(_shown, value))
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(getattr(value, "name", None), str):
        return f"{type(value).__name__}({value.name!r})"
    if dataclasses.is_dataclass(value):  # e.g. a Request: its first field names it
        first = dataclasses.fields(value)[0].name
        return f"{type(value).__name__}({first}={getattr(value, first)!r}, ...)"
    return text


def your_turn(yours: Callable, library: Callable, inputs: Sequence[tuple],
              atol: float = 0.0, rtol: float = 0.0) -> Callable:
    """`yours` if it gives `library`'s result on every tuple of arguments in `inputs` (tensors
    within atol/rtol, floats within atol/rtol or 1e-12 relative, ints as ints, anything else
    equal); `library` if `yours` raises NotImplementedError.

    Raises:
        AssertionError: `yours` differs on an input (the input and both results in the message).
        ValueError: no inputs to check against.
    """
    if not inputs:
        raise ValueError("your_turn needs at least one tuple of arguments to check with")
    name = getattr(yours, "__name__", "your function")
    try:
        results = [yours(*args) for args in inputs]
    except NotImplementedError:
        print(f"{name}: not written yet, so kvlab's ({library.__module__}.{library.__qualname__}) "
              f"stands in for it. Write it, then run this cell again.")
        return library
    for args, result in zip(inputs, results):
        expected = library(*args)
        if not _same(result, expected, atol, rtol):
            raise AssertionError(
                f"{name}({', '.join(map(_shown, args))}) gives {_shown(result)}; kvlab's gives "
                f"{_shown(expected)}{_difference(result, expected, atol, rtol)}")
    print(f"{name}: yours gives kvlab's results on all {len(inputs)} inputs")
    return yours
