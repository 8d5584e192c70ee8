"""How stage 5's benchmark times a call, and what it records of the code that ran.

* Timing: `triton.testing.do_bench` launches the call back to back and reports the median. A
  decode step of a few MiB takes a few microseconds on a GPU, less than Python needs to launch
  the kernel, so there the figure would be the launch's, not the kernel's. Points that move at
  most `BenchConfig.graph_max_bytes` are timed from a CUDA graph instead
  (`triton.testing.do_bench_cudagraph`, built on `torch.cuda.CUDAGraph`): the calls are captured
  once and replayed without Python, as vLLM replays its decode steps. On a CPU (toy mode) one
  timed run after a warm-up: it only shows that the code runs. Notebooks 05b and 05c time PyTorch
  on the CPU with "cpu_best", the fastest of 5 runs after a warm-up: on a machine shared with other
  work, the slower runs time the other work too (the advice of Python's `timeit`).
* SDPA's backend: `torch._fused_sdp_choice` is the dispatcher's own choice for these inputs. If it
  is MATH (the unfused reference, used when no fused kernel accepts them), "vs SDPA" would compare
  with an implementation no server uses; the record says which one ran.
* The kernel's registers and shared memory, from the binary that was launched: a Triton launch
  returns its CompiledKernel, with `n_regs`, `n_spills` (registers spilled to local memory) and
  `metadata.shared` (bytes per program), the figures `kvlab.tools.compiled` reads from a
  compile without a GPU.
"""

from __future__ import annotations

import time

import torch

__all__ = ["TIMINGS", "timing_for", "median_ms", "sdpa_backend", "kernel_record"]

TIMINGS = ("do_bench", "cuda_graph", "cpu_once", "cpu_best")


def timing_for(device: torch.device, bytes_moved: int, graph_max_bytes: int) -> str:
    """Which of TIMINGS a point is timed with: on a CPU "cpu_once"; on a GPU "cuda_graph" when it
    moves at most graph_max_bytes, else "do_bench"."""
    if device.type != "cuda":
        return "cpu_once"
    return "cuda_graph" if bytes_moved <= graph_max_bytes else "do_bench"


def median_ms(fn, timing: str, repeats: int = 5) -> float:
    """Median milliseconds of fn() under `timing` (one of TIMINGS; "cpu_best": the fastest of
    `repeats` runs instead). ValueError: another name."""
    if timing == "do_bench":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    if timing == "cuda_graph":
        import triton.testing
        fn()  # compile and allocate outside the capture
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    if timing == "cpu_once":
        fn()  # warm-up (the interpreter's first call parses the kernel)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    if timing == "cpu_best":
        fn()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return min(runs) * 1e3
    raise ValueError(f"unknown timing {timing!r}: expected one of {', '.join(TIMINGS)}")


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """The SDPBackend name (FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH, ...) that
    `scaled_dot_product_attention(query, key, value, enable_gqa=True)` dispatches to; "unknown:
    <error>" where this torch cannot say."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(query, key, value, enable_gqa=True)).name
    except Exception as error:  # noqa: BLE001 - a torch without the private query
        return f"unknown: {type(error).__name__}: {str(error)[:120]}"


def kernel_record(launch, kernel) -> dict:
    """What one decode launch ran: grid, splits and TILE from the plan (`DecodeLaunch`), and from
    the compiled kernel the launch returned its registers per thread, registers spilled, shared
    memory per program in bytes, warps and pipeline stages (None under the interpreter, whose
    launches return no binary)."""
    record = dict(grid=list(launch.grid), num_splits=launch.grid[2], tile=launch.constants["TILE"],
                  registers=None, spilled=None, shared_bytes=None, num_warps=None,
                  num_stages=None)
    if kernel is not None and hasattr(kernel, "metadata"):
        kernel._init_handles()  # n_regs and n_spills are read when the binary is loaded
        record.update(registers=kernel.n_regs, spilled=kernel.n_spills,
                      shared_bytes=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                      num_stages=kernel.metadata.num_stages)
    return record
