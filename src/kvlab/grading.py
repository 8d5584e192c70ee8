"""Assertions for the exercise tests: each failure is one line naming the call, expected and got.

`kvlab check` prints that line to the learner, e.g. "max_concurrent_requests(gpu_bytes=12000, ...):
expected int 3, got float 3.33". The checks are strict where the lesson is exactness: an integer
answer must be an `int` (a float or a bool fails); a tensor must have the expected dtype and be
finite where the expected one is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    shown = f"{value:,}" if type(value) is int else repr(value)  # 327,680: bytes read easier
    text = f"{type(value).__name__} {shown}"
    return text if len(text) <= 100 else text[:97] + "..."


def _types(value: Any) -> Any:
    """The types inside a value: (list, (int, int)) for [1, 2], so that [1, 2.0] differs."""
    if isinstance(value, (list, tuple)):
        return type(value), tuple(map(_types, value))
    if isinstance(value, dict):
        return dict, {key: _types(item) for key, item in value.items()}
    return type(value)


def assert_equal(got: Any, expected: Any, what: str) -> None:
    """Equal values of the same types (inside lists, tuples and dicts too): 2.0 or True is not 2.

    Raises:
        AssertionError: "<what>: expected int 327,680, got float 327680.0".
    """
    if got != expected or _types(got) != _types(expected):
        raise AssertionError(f"{what}: expected {_show(expected)}, got {_show(got)}")


def assert_close(got: Any, expected: torch.Tensor, what: str, atol: float = 1e-6,
                 rtol: float = 1e-6) -> None:
    """A tensor of the expected shape and dtype, finite, with |got - expected| <= atol + rtol|e|.

    Raises:
        AssertionError: naming the first check that failed; for values, how many differ and the
            worst ("3 of 80 values differ; worst at [2, 5]: expected 0.8134, got 0.7962 ...").
    """
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected {_show(expected)}, got {_show(got)}")
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {list(expected.shape)}, got "
                             f"{list(got.shape)}")
    if got.dtype != expected.dtype:  # e.g. float64 from float32 inputs: the wrong precision
        raise AssertionError(f"{what}: expected dtype {expected.dtype}, got {got.dtype}")
    got64, expected64 = got.detach().double().cpu(), expected.detach().double().cpu()
    bad = ~torch.isfinite(got64) & torch.isfinite(expected64)
    if bad.any():  # NaN fails no tolerance test below (NaN > tol is False): catch it here
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite values; at {list(at)} "
                             f"expected {expected64[at].item():.6g}, got {got64[at].item()}")
    excess = (got64 - expected64).abs() - (atol + rtol * expected64.abs())
    if got64.numel() and excess.max() > 0:
        at = tuple(int(i) for i in torch.unravel_index(excess.argmax(), got64.shape))
        e, g = expected64[at].item(), got64[at].item()
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {got64.numel()} values "
                             f"differ; worst at {list(at)}: expected {e:.6g}, got {g:.6g} "
                             f"(tolerance {atol + rtol * abs(e):.2g})")


def expect_raises(error_type: type[BaseException], call: Callable[[], Any],
                  what: str) -> BaseException:
    """Return the `error_type` that `call()` raises; a "TODO" NotImplementedError passes through
    (so `kvlab check` shows its hint).

    Raises:
        AssertionError: `call()` returned, or raised another type (both named).
    """
    try:
        result = call()
    except error_type as error:
        return error
    except Exception as error:  # noqa: BLE001 - the wrong exception is the finding
        if isinstance(error, NotImplementedError) and str(error).startswith("TODO"):
            raise
        raise AssertionError(f"{what}: expected {error_type.__name__}, got "
                             f"{type(error).__name__}: {error}") from None
    raise AssertionError(f"{what}: expected {error_type.__name__} to be raised, but it returned "
                         f"{_show(result)}")
