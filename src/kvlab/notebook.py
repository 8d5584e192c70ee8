"""One call at the top of every notebook: device, Triton mode, seeds, threads, quiet known warnings.

In the order that matters: 1. the device and dtype (`kvlab.device`); 2. without CUDA,
TRITON_INTERPRET=1, which Triton reads when a kernel is *defined*, so call `setup()` before
importing any kernel (the result says if Triton came first); 3. seeds for Python, NumPy (if
installed) and torch; 4. torch's CPU threads (default 1: on a shared CPU a pool costs more than
the tiny tensors save); 5. silences only `KNOWN_HARMLESS_WARNINGS`, by message and category.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import warnings

__all__ = ["KNOWN_HARMLESS_WARNINGS", "NotebookEnvironment", "setup"]

# (message regex, category, why it is harmless). Each is matched on its message start only.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"IProgress not found", Warning,
     "tqdm.auto without ipywidgets falls back to a text progress bar; the figures are the same"),
)


@dataclasses.dataclass(frozen=True)
class NotebookEnvironment:
    """What `setup` chose; triton_imported_before: too late for defined kernels to be interpreted."""

    device: str
    dtype: str
    triton_interpret: bool
    triton_imported_before: bool
    seed: int
    num_threads: int
    silenced: tuple[str, ...]

    def __str__(self) -> str:
        triton = "TRITON_INTERPRET=1" if self.triton_interpret else "Triton on the GPU"
        threads = f"{self.num_threads} thread{'s' if self.num_threads != 1 else ''}"
        line = f"kvlab setup: {self.device}, {self.dtype}, {triton}, seed {self.seed}, {threads}"
        if self.triton_imported_before and self.triton_interpret:
            line += ("\nwarning: triton was imported before setup(); restart the kernel and call "
                     "setup() first so kernels run in the interpreter")
        return line


def setup(seed: int = 0, num_threads: int | None = 1, quiet: bool = False) -> NotebookEnvironment:
    """What was chosen, printed unless quiet; num_threads None leaves torch's default.
    ValueError: seed < 0 or num_threads < 1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive integer or None, got {num_threads!r}")
    triton_imported_before = "triton" in sys.modules

    import torch  # does not import triton

    from .device import default_device, default_dtype

    device = default_device()
    interpret = device.type != "cuda"
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"

    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if num_threads is not None:
        torch.set_num_threads(num_threads)

    for message, category, _why in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)

    env = NotebookEnvironment(
        device=str(device), dtype=str(default_dtype(device)).replace("torch.", ""),
        triton_interpret=interpret, triton_imported_before=triton_imported_before, seed=seed,
        num_threads=torch.get_num_threads(),
        silenced=tuple(message for message, _, _ in KNOWN_HARMLESS_WARNINGS))
    if not quiet:
        print(env)
    return env
