"""One call at the top of every notebook: device, Triton mode, seeds, threads, quiet known warnings.

    from kvlab.notebook import setup
    env = setup(seed=0)     # prints e.g. "kvlab setup: cpu, float32, TRITON_INTERPRET=1, seed 0, 1 thread"

What it does, in the order that matters:

1. Picks the device (`kvlab.device`): a CUDA GPU if there is one, else the CPU; and the dtype the
   course uses there (float32 on CPU, bf16 or fp16 on a GPU).
2. Without CUDA, sets TRITON_INTERPRET=1 so stage 5's Triton kernels run in Triton's interpreter
   on the CPU. Triton reads it when a kernel is *defined*, so this must happen before any kernel
   module is imported: call `setup()` first. If Triton was already imported, the result says so.
3. Seeds Python's, NumPy's (when installed) and torch's random generators.
4. Sets torch's CPU thread count (default 1: the course's tensors are tiny, and on a shared CPU a
   thread pool costs more than it saves).
5. Silences only the warnings named in `KNOWN_HARMLESS_WARNINGS`, each by its message and
   category. A learner's own warnings, and every other library warning, still show.
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
    """What `setup` chose.

    Attributes:
        device: "cuda:0" or "cpu".
        dtype: the torch dtype the course uses on that device.
        triton_interpret: whether TRITON_INTERPRET=1 is set (no CUDA).
        triton_imported_before: Triton was imported before `setup` ran (too late for kernels
            already defined to switch to the interpreter).
        seed: the seed given to Python, NumPy and torch.
        num_threads: torch's CPU threads.
        silenced: the messages of the warnings silenced.
    """

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
    """Prepare a notebook: device, TRITON_INTERPRET, seeds, threads, known-harmless warnings.

    Args:
        seed: seeds `random`, NumPy (if installed) and torch (CPU and CUDA).
        num_threads: torch CPU threads; None leaves torch's default.
        quiet: do not print the one-line summary.

    Returns:
        NotebookEnvironment: what was chosen (also printed unless quiet).

    Raises:
        ValueError: seed < 0 or num_threads < 1.
    """
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
