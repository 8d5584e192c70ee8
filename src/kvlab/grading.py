"""Assertions for the exercise tests; a failure is one line, naming the call, expected and got,
that `kvlab check` prints. Strict where the lesson is exactness: an integer answer must be an `int`
(not a float or a bool); a tensor must have the expected dtype and be finite where expected is."""

from typing import Any, Callable

import torch


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    text = f"{type(value).__name__} {f'{value:,}' if type(value) is int else repr(value)}"
    return text if len(text) <= 100 else text[:97] + "..."


def _types(value: Any) -> Any:  # [1, 2.0] -> (list, {0: int, 1: float}): not the same as [1, 2]
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return type(value), {key: _types(item) for key, item in items}
    return type(value)


def assert_equal(got: Any, expected: Any, what: str) -> None:
    """Equal values of the same types (inside lists, tuples and dicts too): 2.0 or True is not 2.
    Raises AssertionError: "<what>: expected int 327,680, got float 327680.0"."""
    if got != expected or _types(got) != _types(expected):
        raise AssertionError(f"{what}: expected {_show(expected)}, got {_show(got)}")


def assert_close(got: Any, expected: torch.Tensor, what: str, atol: float = 1e-6,
                 rtol: float = 1e-6) -> None:
    """A tensor of the expected shape and dtype, within |got - expected| <= atol + rtol |expected|
    everywhere; NaN or inf where `expected` is finite fails. Raises AssertionError, one line:
    "<what>: expected tensor [2, 3] float32, got tensor [2, 3] float64", or "<what>: 3 of 80 values
    differ; worst at [2, 5]: expected 0.8134, got nan (tolerance 1.8e-06)"."""
    if (not isinstance(got, torch.Tensor) or got.shape != expected.shape
            or got.dtype != expected.dtype):  # e.g. float64 from float32 inputs: wrong precision
        raise AssertionError(f"{what}: expected {_show(expected)}, got {_show(got)}")
    got64, expected64 = got.detach().double().cpu(), expected.detach().double().cpu()
    excess = ((got64 - expected64).abs() - atol - rtol * expected64.abs()).nan_to_num(0.0)
    excess[~got64.isfinite() & expected64.isfinite()] = float("inf")  # NaN > tolerance is False
    if (excess > 0).any():
        at = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        e, g = expected64[at].item(), got64[at].item()
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {excess.numel()} values "
                             f"differ; worst at {list(at)}: expected {e:.6g}, got {g:.6g} "
                             f"(tolerance {atol + rtol * abs(e):.2g})")


def expect_raises(error_type: type[BaseException], call: Callable[[], Any],
                  what: str) -> BaseException:
    """The `error_type` that `call()` raises; a "TODO" NotImplementedError passes through. Raises
    AssertionError: "<what>: expected ValueError to be raised, but it returned int 3" (or "but it
    raised KeyError: 5")."""
    try:
        outcome = f"it returned {_show(call())}"
    except error_type as error:
        return error
    except Exception as error:  # noqa: BLE001 - the wrong exception is the finding
        if isinstance(error, NotImplementedError) and str(error).startswith("TODO"):
            raise  # for `kvlab check` to show its hint
        outcome = f"it raised {type(error).__name__}: {error}"
    raise AssertionError(f"{what}: expected {error_type.__name__} to be raised, but {outcome}")
