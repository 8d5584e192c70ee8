"""One vocabulary for storage dtypes: a name, a torch dtype, or an element size, all mean the same.

Sizing speaks in short names ("bf16"), the caches allocate `torch.dtype`s, a byte count is an
element size; `resolve_dtype` turns any into one `DType`. A size alone names a dtype only when
unambiguous (4 is fp32, 1 is fp8, 2 could be bf16 or fp16: `resolve_dtype(2)` refuses,
`dtype_bytes(2)` accepts). torch is imported only for a torch dtype: `kvlab size` starts without it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "DTypeLike", "DTYPES", "resolve_dtype", "torch_dtype", "dtype_name",
           "dtype_bytes"]


@dataclasses.dataclass(frozen=True)
class DType:
    """name ("bf16"), bytes per element, torch_name (fp8: "float8_e4m3fn", vLLM's fp8 KV dtype)."""
    name: str
    bytes: int
    torch_name: str

    @property
    def torch(self) -> "torch.dtype":
        """The `torch.dtype` (imports torch)."""
        import torch
        return getattr(torch, self.torch_name)


DTYPES = (DType("fp32", 4, "float32"), DType("bf16", 2, "bfloat16"), DType("fp16", 2, "float16"),
          DType("fp8", 1, "float8_e4m3fn"))

# Every spelling a reader may type, lower case, mapped to its DType.
_BY_SPELLING = {}
for _dtype in DTYPES:
    for _spelling in (_dtype.name, _dtype.torch_name, f"torch.{_dtype.torch_name}"):
        _BY_SPELLING[_spelling] = _dtype
_BY_SPELLING.update({"float8": DTYPES[3], "half": DTYPES[2], "float": DTYPES[0]})

DTypeLike = Union[str, "torch.dtype", int, DType]


def _names() -> str:
    return ", ".join(d.name for d in DTYPES)


def resolve_dtype(dtype: DTypeLike) -> DType:
    """The `DType` of a name ("bf16", "bfloat16", "float8", ...), torch dtype, unambiguous element
    size or `DType`; ValueError naming the value and what is accepted otherwise."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, bool):
        raise ValueError(f"dtype must be a name, torch dtype or element size, got {dtype!r}")
    if isinstance(dtype, int):
        matches = [d for d in DTYPES if d.bytes == dtype]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise ValueError(f"an element size of {dtype} bytes could be "
                             f"{' or '.join(d.name for d in matches)}; name the dtype")
        raise ValueError(f"no dtype of the course has {dtype}-byte elements; use one of {_names()}")
    # A torch.dtype prints as "torch.bfloat16"; reading it as text keeps torch out of this module.
    key = str(dtype).lower() if isinstance(dtype, str) or _is_torch_dtype(dtype) else None
    if key is None:
        raise ValueError(f"dtype must be a name, torch dtype or element size, got {dtype!r}")
    try:
        return _BY_SPELLING[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {_names()}") from None


def _is_torch_dtype(value) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def torch_dtype(dtype: DTypeLike) -> "torch.dtype":
    """As `resolve_dtype`, the torch dtype."""
    return resolve_dtype(dtype).torch


def dtype_name(dtype: DTypeLike) -> str:
    """As `resolve_dtype`, the short name ("bf16", "fp16", "fp32", "fp8")."""
    return resolve_dtype(dtype).name


def dtype_bytes(dtype: DTypeLike) -> int:
    """Bytes per element; a course dtype's element size (1, 2, 4) is accepted as is."""
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in {d.bytes for d in DTYPES}:
        return dtype
    return resolve_dtype(dtype).bytes
