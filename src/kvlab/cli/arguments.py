"""Argument types shared by the subcommands: bounded numbers and the dtype names.

Bounds keep a typo (`--seq-len 1e20`) from printing a 25-digit size; argparse turns the
`ArgumentTypeError` into a one-line usage error with exit status 2, like every other bad input.
"""

from __future__ import annotations

import argparse
import math

from ..dtypes import DTYPES as DTYPE_LIST

__all__ = ["DTYPES", "positive_int", "int_up_to", "positive_float", "float_up_to"]

DTYPES = tuple(dtype.name for dtype in DTYPE_LIST)  # bf16, fp16, fp32, fp8 (kvlab.dtypes)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def int_up_to(top: int):
    """argparse type: a whole number in [1, top]."""
    return _at_most(positive_int, top, "{:,}".format)


def float_up_to(top: float):
    """argparse type: a number in (0, top]."""
    return _at_most(positive_float, top, "{:g}".format)


def _at_most(parse, top, show):
    """`parse`, then refuse a value above `top` (both shown with `show`)."""
    def parse_bounded(text: str):
        value = parse(text)
        if value > top:
            raise argparse.ArgumentTypeError(f"expected at most {show(top)}, got {show(value)}")
        return value
    return parse_bounded
