"""What Triton's GPU compiler makes of the decode kernel, read on a machine without a GPU.

A Triton kernel is compiled for the GPU it first runs on; `triton.compile` does the same ahead of
time for any target, here sm_90 (H100/H200), down to TTGIR (Triton's GPU-level IR, where the
software pipeliner's buffers and waits show), PTX and a cubin. Two things make it the binary that
would run:

* the arguments are those `paged_attention_decode` launches with (`plan_decode`), built on "meta"
  tensors, which have shapes, dtypes and strides but no memory;
* they are specialised as the JIT specialises a launch, with Triton's own binder: a pointer or an
  integer divisible by 16 is marked so (`tt.divisibility`), an integer equal to 1 (a unit stride)
  becomes a constant. Compiled from plain `i32` arguments instead, the same source gives another
  binary, with other registers and shared memory.

Read from the compile (`CompiledDecode`): the loop's K buffers, `ttg.local_alloc ... memdesc<N x
TILE x HEAD_DIM>` (N tiles of K in shared memory, so N - 1 can be in flight while one is read), its
wait, `ttg.async_wait {num = n}` (block until at most n copy groups are outstanding: 0 waits for
every copy), the loop op itself (`scf.for`, which Triton's software pipeliner transforms, or
`scf.while`, which it leaves alone) and its asynchronous copies, registers per thread and shared
memory per program (cuobjdump, which Triton's NVIDIA backend ships, reads the cubin).

The compiler is not there under TRITON_INTERPRET=1 (notebooks, tests): `compile_in_subprocess`
runs `python -m kvlab.tools.compiled` without it and returns its JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["CompiledDecode", "HEADLINE", "compile_decode", "compile_launch", "loop_lines",
           "annotate_loop", "cubin_resources", "compile_in_subprocess", "decode_variant",
           "plot_loop_timeline", "main"]

# The headline decode step: Llama-3.1-8B's attention (32 query / 8 KV heads, head_dim 128), bf16,
# batch 64 x 4,096 tokens in blocks of 16.
HEADLINE = dict(num_seqs=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                block_size=16, dtype="bfloat16")
# The pool's block count does not change a byte of the binary (no argument depends on it).
_META_BLOCKS = 4


@dataclass(frozen=True)
class CompiledDecode:
    """One compile of `_paged_decode_kernel`; bytes per program, registers per thread."""

    arch: int
    triton_version: str
    shape: dict
    tile: int
    prefetch_ids: bool
    split: bool
    kv_buffers: int      # K (likewise V) tiles in shared memory; 0 without async copies
    wait_num: int | None  # the loop's ttg.async_wait {num = ...}
    buffer_line: str | None  # the TTGIR line that allocates K's buffers
    wait_line: str | None  # the loop's TTGIR wait line
    registers: int
    shared_bytes: int    # dynamic shared memory the launch asks for
    static_shared_bytes: int
    num_warps: int
    num_stages: int
    seconds: float       # the compile's wall time
    loop: str = ""       # the decode loop's TTGIR op: "scf.for" (pipelined) or "scf.while"
    async_copies: int = 0  # ttg.async_copy_global_to_local ops (cp.async): 0, nothing in flight
    listing: list = field(default_factory=list)  # annotate_loop's [label, TTGIR line] pairs


def compile_launch(fn, args: tuple, kwargs: dict, arch: int):
    """triton.compile of the JIT function `fn` for sm_`arch`, with `args` and `kwargs` (constexprs
    and options such as num_stages) specialised as a launch would specialise them. Returns
    Triton's CompiledKernel (asm: ttgir, ptx, cubin; metadata: shared, num_warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _strip_location(line: str) -> str:
    return re.sub(r"\s*loc\(#loc\d*\)$", "", line.strip())


def loop_lines(ttgir: str, tile: int, head_dim_pad: int) -> tuple[str | None, int, str | None,
                                                                 int | None]:
    """(the line allocating K's [N, tile, head_dim_pad] buffers, N, the first async_wait in the
    decode loop, its num); (None, 0, None, None) when the loop copies nothing asynchronously (no
    cp.async before sm_80). ValueError: buffers but no loop or no wait in it."""
    lines = ttgir.splitlines()
    shape = re.compile(rf"ttg\.local_alloc\s*:.*memdesc<(\d+)x{tile}x{head_dim_pad}x")
    buffers = [line for line in lines if shape.search(line)]
    if not buffers:
        return None, 0, None, None
    loop = next((i for i, line in enumerate(lines) if "scf.for" in line), None)
    if loop is None:
        raise ValueError("no scf.for loop in the TTGIR")
    body = lines[loop:next(i for i in range(loop, len(lines)) if "scf.yield" in lines[i])]
    waits = [line for line in body if "ttg.async_wait" in line]
    if not waits:
        raise ValueError("no ttg.async_wait in the decode loop")
    num = int(re.search(r"num = (\d+)", waits[0]).group(1))
    return (_strip_location(buffers[0]), int(shape.search(buffers[0]).group(1)),
            _strip_location(waits[0]), num)


def _short(line: str) -> str:
    """A TTGIR line without its location, its result types and a for's iter_args."""
    line = _strip_location(line)
    if "ttg.local_alloc : ()" in line:
        return re.sub(r"!ttg\.(memdesc<[^,]*),.*", r"\1, ...>", line)
    return re.sub(r" iter_args\(.*| : (tensor|!|\(|<).*", "", line)


def _copied(line: str) -> str:
    """What a TTGIR copy (its result's name) or read (its buffer's name) moves: "K", "V", "ids"."""
    read = re.search(r"ttg\.local_load (%\w+)", line)
    name = read.group(1) if read else _short(line)
    return "V" if name.startswith("%v") else "K" if name.startswith("%k") else "ids"


def annotate_loop(ttgir: str, tile: int, head_dim_pad: int) -> list[list[str]]:
    """The pipelined decode loop's key TTGIR lines as [label, line] pairs: K's buffers, the
    prologue's copies (one shown, all counted), the scf.for, and in its body the wait, the reads of
    K and V from shared memory, the two dots, the block-id load, the copies it issues and the
    scf.yield, and before the load and the copies the `start + constant` that picks their tile.
    [] when the loop copies nothing asynchronously (no buffers)."""
    lines = ttgir.splitlines()
    shape = re.compile(rf"ttg\.local_alloc\s*:.*memdesc<(\d+)x{tile}x{head_dim_pad}x")
    alloc = next((i for i, line in enumerate(lines) if shape.search(line)), None)
    loop = next((i for i, line in enumerate(lines) if "scf.for" in line), None)
    if alloc is None or loop is None:
        return []
    end = next(i for i in range(loop, len(lines)) if "scf.yield" in lines[i])
    buffers = shape.search(lines[alloc]).group(1)
    prologue = [line for line in lines[alloc:loop] if "ttg.async_copy_global_to_local" in line]
    counts = {what: sum(_copied(line) == what for line in prologue) for what in ("K", "V", "ids")}
    listing = [[f"K's buffers: {buffers} tile(s) in shared memory (V's: a second alloc)",
                lines[alloc]]]
    if prologue:
        kinds = ", ".join(f"{n} tile(s)' {what}" for what, n in counts.items() if n)
        listing.append([f"before the loop: {len(prologue)} copies like this ({kinds})",
                        prologue[0]])
    listing.append(["the loop: iteration i computes tile i", lines[loop]])
    body = {"ttg.async_wait": "wait until at most {num} copies fly: tile i is in",
            "ttg.local_load": "read tile i's {what} from its buffer",
            "tt.dot": "{dot}",
            "tt.load": "load tile i + {ahead}'s block ids (into registers)",
            "ttg.async_copy_global_to_local": "issue a later tile's {what} copy"}
    dots = iter(["scores = q . K^T", "acc += p . V"])
    start = re.search(r"scf\.for (%\w+) =", lines[loop]).group(1)  # tile i's first position
    shift, ahead = None, "?"  # the last `start + constant` line, unshown, and its tile count
    for line in lines[loop + 1:end]:
        found = re.search(rf"arith\.addi {start}, %c(\d+)_i32", line)
        if found:
            ahead = int(found.group(1)) // tile
            shift = [f"tile i + {ahead}: tile i's start + {found.group(1)} tokens", line]
            continue
        op = next((op for op in body if f" {op} " in line), None)
        if op is None or (op == "ttg.local_load" and " token " not in line):
            continue  # q's and p's shared-memory round trips are not the pipeline
        if shift and op in ("tt.load", "ttg.async_copy_global_to_local"):
            listing.append(shift)  # shown once, before the load or the copies it addresses
            shift = None
        found = re.search(r"num = (\d+)", line)
        label = body[op].format(num=found.group(1) if found else "", what=_copied(line),
                                dot=next(dots, "a dot") if op == "tt.dot" else "", ahead=ahead)
        listing.append([label, line])
    listing.append(["next iteration: acc, m, l, ids, buffer indices", lines[end]])
    return [[label, _short(line)] for label, line in listing]


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, static shared memory in bytes) of the cubin's one kernel, as
    `cuobjdump -res-usage` reports them. RuntimeError: cuobjdump missing or unreadable output."""
    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(cubin)
        report = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
    found = re.search(r"REG:(\d+).*?SHARED:(\d+)", report.stdout)
    if report.returncode or not found:
        raise RuntimeError(f"{tool} -res-usage gave no REG/SHARED: {report.stderr[-500:]}")
    return int(found.group(1)), int(found.group(2))


def compile_decode(arch: int = 90, prefetch_ids: bool = True, tile: int | None = None,
                   split: bool = False, num_stages: int | None = None, while_loop: bool = False,
                   **shape) -> CompiledDecode:
    """Compile the decode kernel as `paged_attention_decode` would launch it on an sm_`arch` GPU
    with 132 SMs, for HEADLINE's shape with `shape`'s changes (dtype a torch dtype's name).
    split True compiles the split-KV variant (two splits); while_loop True the loop written as a
    `while`, as the interpreter runs it (no `scf.for`: nothing is pipelined). Needs Triton's
    compiler (no TRITON_INTERPRET) with its NVIDIA backend."""
    import triton

    from kvlab.kernels import paged_attention as pa

    if pa.INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1: no compiler here (use compile_in_subprocess)")
    shape = dict(HEADLINE, **shape)
    dtype = getattr(torch, shape["dtype"])
    num_seqs, context, block_size = shape["num_seqs"], shape["context"], shape["block_size"]
    width = -(-context // block_size)
    meta = dict(device="meta")
    query = torch.empty(num_seqs, shape["num_heads"], shape["head_dim"], dtype=dtype, **meta)
    pool = torch.empty(_META_BLOCKS, block_size, shape["num_kv_heads"], shape["head_dim"],
                       dtype=dtype, **meta)
    block_tables = torch.empty(num_seqs, width, dtype=torch.int32, **meta)
    seq_lens = torch.empty(num_seqs, dtype=torch.int32, **meta)
    launch = pa.plan_decode(query, pool, pool, block_tables, seq_lens, torch.empty_like(query),
                            context, 2 if split else 1, num_sms=132,
                            capability=(arch // 10, arch % 10), tile=tile,
                            prefetch_ids=prefetch_ids, while_loop=while_loop)
    kwargs = dict(launch.constants)
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    start = time.perf_counter()
    kernel = compile_launch(pa._paged_decode_kernel, launch.args, kwargs, arch)
    seconds = time.perf_counter() - start
    buffer_line, buffers, wait_line, num = loop_lines(
        kernel.asm["ttgir"], kwargs["TILE"], kwargs["HEAD_DIM_PAD"])
    registers, static_shared = cubin_resources(kernel.asm["cubin"])
    ttgir = kernel.asm["ttgir"]
    loop = next((op for op in ("scf.while", "scf.for") if op in ttgir), "none")  # the one loop
    return CompiledDecode(arch, triton.__version__, shape, kwargs["TILE"], prefetch_ids, split,
                          buffers, num, buffer_line, wait_line, registers, kernel.metadata.shared,
                          static_shared, kernel.metadata.num_warps, kernel.metadata.num_stages,
                          round(seconds, 2), loop, ttgir.count("ttg.async_copy_global_to_local"),
                          annotate_loop(ttgir, kwargs["TILE"], kwargs["HEAD_DIM_PAD"]))


def compile_in_subprocess(variants: list[dict], timeout: float = 600) -> list[dict] | str:
    """`compile_decode(**variant)` for each variant, in a Python without TRITON_INTERPRET; the
    results as dicts, or a string saying why there are none (no NVIDIA backend in this Triton).
    RuntimeError with the child's error when it fails otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default; set so Triton 3.9 does not warn
    run = subprocess.run([sys.executable, "-m", "kvlab.tools.compiled", json.dumps(variants)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"compiling failed:\n{run.stderr[-3000:]}")
    report = json.loads(run.stdout.strip().splitlines()[-1])
    return report.get("skip") or report["results"]


def decode_variant(point: dict, prefetch_ids: bool = True, num_stages: int | None = None,
                   while_loop: bool = False):
    """A function of no arguments that runs one decode step of `point`
    (`bench_paged_attention.make_point`, its shuffled block table) with the kernel built as
    `compile_decode` builds the variant (one split); it returns the output [num_seqs, num_heads,
    head_dim]. To time the variants on a GPU; on the CPU it runs under the interpreter."""
    from kvlab.kernels import paged_attention as pa

    query = point["query"]
    on_gpu = query.is_cuda and not pa.INTERPRETED
    capability = torch.cuda.get_device_capability(query.device) if query.is_cuda else None
    num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count if on_gpu else 1
    launch = pa.plan_decode(query, point["k_cache"], point["v_cache"], point["shuffled"],
                            point["seq_lens"], torch.empty_like(query), point["context"], 1,
                            num_sms, capability, layout=point["layout"], prefetch_ids=prefetch_ids,
                            while_loop=while_loop)
    constants = dict(launch.constants)
    if num_stages is not None and on_gpu:  # the interpreter has no pipeline to size
        constants["num_stages"] = num_stages

    def run() -> torch.Tensor:
        pa._paged_decode_kernel[launch.grid](*launch.args, **constants)
        return launch.args[0]
    return run


def plot_loop_timeline(compiles: dict, iterations: int = 5, latency: float = 3.0,
                       compute: float = 1.0):
    """A schematic timeline of one program's decode loop per compile (name -> `CompiledDecode`
    dict): each iteration's wait (grey) and compute (blue), each tile's copy issued (triangle,
    tile number) and the tiles in flight (number over each bar). A copy takes `latency`, a tile's
    compute `compute` (arbitrary units, assumed: not measured, and fixed however many copies fly,
    so bandwidth is ignored). With N = kv_buffers >= 2 the prologue issues tiles 0 to
    N - 1 and iteration i, after computing tile i, issues tile i + N into its buffer; with fewer
    (one buffer, or the `while`'s registers) tile i + 1 is issued after tile i is computed."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(compiles), 1, figsize=(10, 1.1 * len(compiles) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (name, c) in zip(axes[:, 0], compiles.items()):
        ahead = max(c["kv_buffers"], 1)
        issued = {tile: 0.0 for tile in range(ahead)}
        now = 0.0
        for i in range(iterations):
            ready = issued[i] + latency
            begin = max(now, ready)  # computing starts once tile i is in
            for start, end, colour in ((now, ready, "0.8"), (begin, begin + compute, "tab:blue")):
                if end > start:
                    ax.broken_barh([(start, end - start)], (0, 1), color=colour, edgecolor="white")
                    middle = (start + end) / 2
                    flying = sum(t <= middle < t + latency for t in issued.values())
                    ax.text(middle, 1.1, str(flying), ha="center", fontsize=8)
            now = begin + compute
            issued[i + ahead] = now
        copies: dict[float, list[str]] = {}
        for tile, time in issued.items():
            copies.setdefault(time, []).append(str(tile))
        for time, tiles in copies.items():
            ax.plot(time, -0.35, marker="^", color="tab:orange")
            ax.text(time, -0.95, ",".join(tiles), ha="center", fontsize=7)
        ax.set_yticks([])
        ax.set_ylim(-1.1, 1.6)
        ax.set_ylabel(f"{name}\n{c['loop']}, {c['kv_buffers']} buffer(s)", rotation=0, ha="right",
                      va="center", fontsize=8)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axes[0, 0].legend(handles=[Patch(color="0.8", label="waiting"),
                               Patch(color="tab:blue", label="computing"),
                               Line2D([], [], marker="^", color="tab:orange", linestyle="",
                                      label="tile n's copy issued")],
                      loc="lower right", bbox_to_anchor=(1, 1), fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel(f"time, assumed: a copy takes {latency:g}, a tile's compute "
                           f"{compute:g}, whatever else is in flight (bandwidth ignored); "
                           "number: tiles in flight")
    return axes[:, 0]


def main(argv: list[str] | None = None) -> None:
    """python -m kvlab.tools.compiled '[{"prefetch_ids": false}, {}]': one JSON line."""
    import triton

    argv = sys.argv[1:] if argv is None else argv
    variants = json.loads(argv[0]) if argv else [{}]
    if "nvidia" not in triton.backends.backends:
        print(json.dumps({"skip": f"Triton {triton.__version__} has no NVIDIA backend"}))
        return
    print(json.dumps({"results": [asdict(compile_decode(**variant)) for variant in variants]}))


if __name__ == "__main__":
    main()
