"""Argument types and checks shared by the subcommands.

Bounds keep a typo (`--seq-len 1e20`) from printing a 25-digit size (a one-line usage error, exit
2). No flag is ignored or clamped in silence: a value the model or card cannot take, or a flag
another overrides, is a one-line ValueError.
"""

from __future__ import annotations

import argparse
import math

from ..config import LlamaConfig
from ..dtypes import DTYPES as DTYPE_LIST
from ..tp_fit import smallest_fitting_tp, tp_shortfall

__all__ = ["DTYPES", "positive_int", "int_up_to", "positive_float", "float_up_to",
           "check_lengths", "resolve_tp", "refuse_together"]

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


def check_lengths(config: LlamaConfig, max_model_len: int, block_size: int) -> None:
    """ValueError: max_model_len > max_position_embeddings (vLLM refuses it too) or < block_size."""
    limit = config.max_position_embeddings
    if max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len:,} > {config.name}'s "
                         f"max_position_embeddings={limit:,}")
    if block_size > max_model_len:
        raise ValueError(f"--block-size {block_size:,} > --max-model-len {max_model_len:,}: one "
                         f"block would be longer than any request")


def resolve_tp(tp: int | None, config: LlamaConfig, gpu_name: str, gpu_memory_bytes: int,
               **fit) -> tuple[int, str | None]:
    """(tp, why): --tp if each GPU holds its share, else the smallest that fits and why, if not 1
    (vLLM's default). ValueError: --tp too small (naming the smallest that fits), or none fits."""
    if tp is not None:
        shortfall = tp_shortfall(config, gpu_name, gpu_memory_bytes, tp=tp, **fit)
        if shortfall is None:
            return tp, None
        smallest = smallest_fitting_tp(config, gpu_name, gpu_memory_bytes, **fit)
        raise ValueError(f"{config.name} at tp {tp}: {shortfall}; use --tp {smallest} or more")
    smallest = smallest_fitting_tp(config, gpu_name, gpu_memory_bytes, **fit)
    if smallest == 1:
        return 1, None
    why = tp_shortfall(config, gpu_name, gpu_memory_bytes, tp=1, **fit)
    return smallest, (f"no --tp given, so tp {smallest}: the smallest tensor-parallel size that "
                      f"fits (vLLM's default, tp 1, would not start: {why})")


def refuse_together(args, first: str, second: str, why: str) -> None:
    """ValueError "--a 1 and --b 2: <why>; give one" if both flags are given (absent: None)."""
    one, other = getattr(args, _attribute(first)), getattr(args, _attribute(second))
    if one is not None and other is not None:
        raise ValueError(f"{first} {_shown(one)} and {second} {_shown(other)}: {why}; give one")


def _attribute(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
