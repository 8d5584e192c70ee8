"""Assertions for the exercise tests; a failure is one line, naming the call, expected and got,
that `kvlab check` prints. Strict where the lesson is exactness: an integer answer must be an `int`
(not a float or a bool); a tensor must have the expected dtype and be finite where expected is.

A failure names where got and expected part, never two values cut to the same visible start: a
list or tuple shows its lengths and its first differing index, a dict only the keys that differ,
a bytes hash its first 8 hex digits (stage 6's hash chains, stage 7's scheduler states)."""

from typing import Any, Callable

import torch

from kvlab.prefix.block_hash import short


WIDTH = 100  # characters of one value in a message; longer ones are described, not cut
CONTAINERS = (list, tuple, dict)


def _show(value: Any, length: bool = True) -> str:
    """'int 327,680', 'tensor [2, 3] float32', 'list of 3 [1, 2, 3]' ('list [1, 2, 3]' without
    `length`), 'bytes 5e2a91c0...'; a container too long for WIDTH shows its type and length
    only."""
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    kind = type(value).__name__
    if isinstance(value, CONTAINERS):
        size = f"{kind} of {len(value)}"
        if not _in_full(value):
            return size
        return f"{size if length else kind} {_brief(value)}"
    text = f"{kind} {f'{value:,}' if type(value) is int else _brief(value)}"
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."


def _in_full(value: Any) -> bool:
    """Whether _show prints this container's items (else only its type and length)."""
    return len(f"{type(value).__name__} of {len(value)} {_brief(value)}") <= WIDTH


def _brief(value: Any) -> str:
    """repr, but a bytes hash as its first 8 hex digits (kvlab.prefix.block_hash.short), also
    inside lists, tuples and dicts."""
    if isinstance(value, bytes):
        return f"{short(value)}..." if len(value) > 4 else value.hex()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_brief(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        items = ", ".join(_brief(item) for item in value)
        if isinstance(value, tuple):
            return f"({items},)" if len(value) == 1 else f"({items})"
        return f"[{items}]"
    return repr(value)


def _differences(got: Any, expected: Any, at: str = "", label: str | None = None) -> list[str]:
    """One phrase per place got and expected differ ([] if equal in value and type); `at` is the
    path ("[2]", "['admitted']"), `label` its name in the phrase (default `at`)."""
    where = f"{label or at}: " if label or at else ""
    if got == expected and _types(got) == _types(expected):
        return []
    if type(got) is not type(expected) or not isinstance(got, (*CONTAINERS, str)):
        return [f"{where}expected {_show(expected)}, got {_show(got)}"]
    if isinstance(got, str):
        if max(len(repr(got)), len(repr(expected))) <= WIDTH - 4:  # "str '...'"
            return [f"{where}expected {_show(expected)}, got {_show(got)}"]
        common = min(len(got), len(expected))
        first = next((i for i in range(common) if got[i] != expected[i]), common)
        return [f"{where}expected str of {len(expected):,}, got str of {len(got):,}; first "
                f"difference at {at}[{first}]: expected {expected[first:first + 20]!r}, got "
                f"{got[first:first + 20]!r}"]
    # The whole values head the line at the top, and a sequence's wherever its lengths differ
    # (a dict's missing and extra keys say that themselves).
    in_full = _in_full(got) and _in_full(expected)
    lengths = len(got) != len(expected)
    head = (in_full and not at) or (lengths and not isinstance(got, dict))
    found = [f"{where}expected {_show(expected, lengths)}, got {_show(got, lengths)}"] if head \
        else []
    if isinstance(got, dict):
        for key in [*expected, *(key for key in got if key not in expected)]:
            place = f"{at}[{key!r}]"
            if key not in got:
                found.append(f"{place}: expected {_show(expected[key])}, got no such key")
            elif key not in expected:
                found.append(f"{place}: expected no such key, got {_show(got[key])}")
            else:
                found += _differences(got[key], expected[key], place)
        return found
    common = min(len(got), len(expected))
    if in_full and not common:
        return found  # [] against [3]: nothing more to say
    first = next((i for i in range(common) if _differences(got[i], expected[i])), common)
    place = f"{at}[{first}]"
    if first < common:
        return found + _differences(got[first], expected[first], place,
                                    f"first difference at {place}")
    missing = (f"expected {_show(expected[first])}, got nothing" if len(expected) > first
               else f"expected nothing, got {_show(got[first])}")
    return found + [f"first difference at {place}: {missing}"]


def _types(value: Any) -> Any:  # [1, 2.0] -> (list, {0: int, 1: float}): not the same as [1, 2]
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return type(value), {key: _types(item) for key, item in items}
    return type(value)


def assert_equal(got: Any, expected: Any, what: str) -> None:
    """Equal values of the same types (inside lists, tuples and dicts too): 2.0 or True is not 2.
    Raises AssertionError, one line: "<what>: expected int 327,680, got float 327680.0"; for
    lists "<what>: expected list of 10, got list of 9; first difference at [9]: expected bytes
    d2311e36..., got nothing"; for a dict too long to show, only the keys that differ, "<what>:
    ['admitted']: expected list of 1 [3], got list of 0 []"."""
    found = _differences(got, expected)
    if found:
        raise AssertionError(f"{what}: {'; '.join(found)}")


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
