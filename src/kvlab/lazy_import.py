"""Names a package exports from modules that need torch, imported when first used.

Stage 7's simulation and `kvlab report` never touch a tensor, but `kvlab.paged` and `kvlab.serving`
also export the cache tensors and the model runner; importing torch takes about a second, a tenth
of a whole simulated replay. A package lists those names here instead of importing them, and
Python calls the module-level `__getattr__` this returns for a name not yet loaded (PEP 562);
its `__dir__` lists them too, so a notebook's tab completion offers them before they load.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["on_first_use"]


def on_first_use(package: str, modules: dict[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module `__getattr__` for `package` that imports `.module` when one of its names is
    asked for (AttributeError for any other name, as Python would raise), and its `__dir__`."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{where[name]}", package), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
