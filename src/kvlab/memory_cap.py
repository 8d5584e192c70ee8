"""A real out-of-memory error: the naive reservation under a memory cap the allocator enforces,
then paged allocation and prefix caching serving the same requests under the same cap.

Stage 2's start-up check compares a reservation with a stated budget. Here nothing is compared:
the memory itself is capped, and the naive reservation (`max_num_seqs` slabs of `max_model_len`
tokens, `kvlab.contiguous.ContiguousKVCache`) is simply allocated until the allocator refuses.
Where the cap comes from (`CappedRun.cap` says which one ran):

* **CUDA**: `torch.cuda.set_per_process_memory_fraction` caps PyTorch's caching allocator at
  (what it holds now + the room) / the card's total; past it, `torch.OutOfMemoryError`, which
  `ContiguousKVCache` re-raises as `KVCacheOutOfMemory` with the arithmetic. The cap is lifted
  afterwards.
* **Linux, CPU**: a child process (`python -m kvlab.memory_cap`) loads the model, warms up, and
  caps its own address space with `resource.RLIMIT_AS` at what it already maps + the room. Past
  it `mmap` fails with ENOMEM: Python's allocations raise `MemoryError`, torch's CPU allocator a
  `RuntimeError` ("can't allocate memory", error code 12); both count as the refusal. The cap is
  relative to the child's own size, so it holds on any machine however much RAM it has.
* **elsewhere** (no cap one process can set on itself): `ContiguousKVCache`'s budget check.

The room is `room_bytes` for KV plus `headroom_bytes` for everything else a run allocates
(activations, Python objects): vLLM measures its activation peak with a profiling pass and leaves
the rest of `gpu_memory_utilization` to its block pool (`kvlab.paged.budget`); here the caller
states both. Under the same cap the library's engine (`kvlab.serving.LLMEngine`) then serves the
same requests twice: paged (stage 4: a pool of room_bytes // block bytes blocks, blocks taken as
tokens arrive) and paged + prefix caching (stage 6: requests that share a prompt prefix share its
full blocks). The figures are counts (blocks, requests, steps), so they are the same on every run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Sequence

import torch

from .contiguous import ContiguousKVCache
from .paged.budget import kv_block_bytes
from .sizing import format_bytes, kv_bytes_per_token

__all__ = ["CappedRun", "PagedRun", "run_under_cap", "CHUNK_TOKENS"]

CHUNK_TOKENS = 512  # max_num_batched_tokens of the engine runs


@dataclasses.dataclass
class PagedRun:
    """One run of the engine under the cap: requests finished (of num_requests), the most running
    at once, preemptions, blocks of the pool held at the peak, and the block-table entries at the
    peak (what the same tables would hold without sharing); refusal: the allocator's error if the
    run itself ran out of memory (else None)."""

    prefix_caching: bool
    num_requests: int
    finished: int
    peak_running: int
    num_preemptions: int
    peak_blocks_in_use: int
    peak_blocks_unshared: int
    refusal: str | None = None


@dataclasses.dataclass
class CappedRun:
    """What happened under the cap. cap: which mechanism enforced it, one sentence; naive_bytes:
    what the naive reservation asked for (naive_formula: its arithmetic); naive_refusal: the
    allocator's error ("<type>: <first line>"), None if it fitted; num_blocks / block_bytes: the
    engine's pool; paged, prefix: the two engine runs."""

    mechanism: str  # "cuda", "rlimit" or "budget"
    cap: str
    room_bytes: int
    headroom_bytes: int
    naive_bytes: int
    naive_formula: str
    naive_refusal: str | None
    num_blocks: int
    block_bytes: int
    paged: PagedRun
    prefix: PagedRun

    @classmethod
    def from_dict(cls, data: dict) -> "CappedRun":
        return cls(**{**data, "paged": PagedRun(**data["paged"]),
                      "prefix": PagedRun(**data["prefix"])})


def refusal(error: BaseException) -> str | None:
    """"<type>: <first line>" when `error` is an allocator's refusal (torch.OutOfMemoryError,
    MemoryError and so KVCacheOutOfMemory, torch's CPU allocator's ENOMEM RuntimeError), else
    None. For KVCacheOutOfMemory raised from a CUDA error, the CUDA error's type is named too."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
            isinstance(error, RuntimeError) and "can't allocate memory" in str(error)):
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if "DefaultCPUAllocator" in text:  # drop torch's source location ([enforce fail at ...])
            text = text[text.index("DefaultCPUAllocator"):]
        cause = error.__cause__
        name = type(error).__name__
        if cause is not None and isinstance(cause, torch.OutOfMemoryError):
            name = f"torch.OutOfMemoryError -> {name}"
        return f"{name}: {text}" if text else name
    return None


def run_under_cap(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  max_model_len: int, room_bytes: int, headroom_bytes: int,
                  block_size: int = 16) -> CappedRun:
    """The naive reservation of len(prompts) slabs, then the engine on the prompts, paged and
    paged + prefix, under a cap of room_bytes + headroom_bytes over what is in use now (module
    docstring). On a Linux CPU the run happens in a child process that loads the model again by
    its name (`load_model(model.config.name)`); elsewhere in this process.

    Raises:
        ValueError: no prompts, room_bytes below one max_model_len request's blocks,
            headroom_bytes < 0.
        RuntimeError: the child process failed (its last lines of output in the message).
    """
    if len(prompts) == 0:
        raise ValueError("run_under_cap needs at least one prompt")
    one_request = -(-max_model_len // block_size) * kv_block_bytes(model.config, block_size,
                                                                    model.dtype)
    if room_bytes < one_request or headroom_bytes < 0:
        raise ValueError(f"room_bytes ({room_bytes:,}) must hold one max_model_len={max_model_len} "
                         f"request ({one_request:,} B: the engine's start-up check) and "
                         f"headroom_bytes ({headroom_bytes:,}) be >= 0")
    job = dict(prompts=[list(map(int, p)) for p in prompts], max_new_tokens=max_new_tokens,
               max_model_len=max_model_len, room_bytes=room_bytes, headroom_bytes=headroom_bytes,
               block_size=block_size)
    if model.device.type == "cuda":
        return CappedRun.from_dict(_run(model, "cuda", **job))
    if sys.platform.startswith("linux"):
        return CappedRun.from_dict(_in_child(model.config.name, job))
    return CappedRun.from_dict(_run(model, "budget", **job))


def _in_child(model_name: str, job: dict) -> dict:
    """`python -m kvlab.memory_cap MODEL` on the CPU, the job on stdin, its result on stdout."""
    # glibc: a fixed mmap threshold (128 KiB) returns every large block to the system when it is
    # freed, so the address space the cap counts is what the process really holds (by default
    # glibc raises the threshold after large frees and keeps such blocks in its heap)
    env = {**os.environ, "KVLAB_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    child = subprocess.run([sys.executable, "-m", "kvlab.memory_cap", model_name],
                           input=json.dumps(job), capture_output=True, text=True, env=env,
                           timeout=600)
    if child.returncode != 0:
        tail = "\n".join((child.stdout + child.stderr).strip().splitlines()[-12:])
        raise RuntimeError(f"the capped child process failed (exit {child.returncode}):\n{tail}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _address_space_bytes() -> int:
    """This process's virtual address space now (/proc/self/statm, field 1, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _engine_run(model, prompts, max_new_tokens, max_model_len, num_blocks, block_size,
                prefix_caching: bool) -> PagedRun:
    """The prompts through `LLMEngine`, all admitted at once if the pool allows, prefill in chunks
    of `CHUNK_TOKENS` (small chunks keep the activations small when memory is tight)."""
    from .serving.llm_engine import LLMEngine

    run = PagedRun(prefix_caching, len(prompts), 0, 0, 0, 0, 0)
    try:
        engine = LLMEngine(model, num_blocks, block_size, max_model_len,
                           max_num_seqs=len(prompts), enable_prefix_caching=prefix_caching,
                           max_num_batched_tokens=CHUNK_TOKENS)
        for prompt in prompts:
            engine.add_request(prompt, max_new_tokens)
        while engine.has_unfinished():
            engine.step()
            run.peak_running = max(run.peak_running, len(engine.running))
    except (RuntimeError, MemoryError) as error:
        run.refusal = refusal(error)
        if run.refusal is None:
            raise
        return run
    run.finished = sum(len(engine.outputs(i)[0]) == max_new_tokens for i in range(len(prompts)))
    run.num_preemptions = engine.stats.num_preemptions
    run.peak_blocks_in_use = engine.stats.peak_blocks_in_use
    run.peak_blocks_unshared = engine.stats.peak_blocks_unshared
    return run


def _run(model, mechanism: str, prompts, max_new_tokens, max_model_len, room_bytes,
         headroom_bytes, block_size) -> dict:
    """Cap (mechanism "cuda", "rlimit" or "budget"), try the naive reservation, run the engine."""
    config, device = model.config, model.device
    per_token = kv_bytes_per_token(config, model.dtype)
    naive_bytes = len(prompts) * max_model_len * per_token
    formula = (f"{len(prompts)} seqs x {max_model_len} tokens x {format_bytes(per_token)}/token = "
               f"{format_bytes(naive_bytes)}")
    block_bytes = kv_block_bytes(config, block_size, model.dtype)
    num_blocks = room_bytes // block_bytes
    cap_room = room_bytes + headroom_bytes
    if mechanism != "budget":  # once uncapped, so the cap is over a process that has loaded,
        for prefix_caching in (False, True):  # compiled and cached all the run needs
            _engine_run(model, prompts, max_new_tokens, max_model_len, num_blocks, block_size,
                        prefix_caching)
    if mechanism == "cuda":
        torch.cuda.empty_cache()
        in_use, total = torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)[1]
        fraction = (in_use + cap_room) / total
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        cap = (f"CUDA: torch.cuda.set_per_process_memory_fraction({fraction:.6f}) on "
               f"{torch.cuda.get_device_name(device)}: the {format_bytes(in_use)} PyTorch holds "
               f"+ {format_bytes(cap_room)}")
    elif mechanism == "rlimit":
        import resource

        limit = _address_space_bytes() + cap_room
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY
                                                else min(limit, hard), hard))
        cap = (f"Linux CPU: a child process whose address space resource.RLIMIT_AS caps at what "
               f"it already maps + {format_bytes(cap_room)}")
    else:
        cap = (f"no cap the operating system enforces here ({sys.platform}, {device.type}): "
               f"the budget check of ContiguousKVCache against {format_bytes(room_bytes)}")
    try:
        naive_refusal = None
        try:
            naive = ContiguousKVCache(config, len(prompts), max_model_len, dtype=model.dtype,
                                      device=device,
                                      budget_bytes=room_bytes if mechanism == "budget" else None)
            del naive
        except (RuntimeError, MemoryError) as error:
            naive_refusal = refusal(error)
            if naive_refusal is None:
                raise
        if mechanism == "cuda":
            torch.cuda.empty_cache()  # a half that was granted goes back before the pool
        paged = _engine_run(model, prompts, max_new_tokens, max_model_len, num_blocks, block_size,
                            prefix_caching=False)
        prefix = _engine_run(model, prompts, max_new_tokens, max_model_len, num_blocks,
                             block_size, prefix_caching=True)
    finally:
        if mechanism == "cuda":  # the rest of the notebook gets the whole card again
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            torch.cuda.empty_cache()
    return dataclasses.asdict(CappedRun(mechanism, cap, room_bytes, headroom_bytes, naive_bytes,
                                        formula, naive_refusal, num_blocks, block_bytes, paged,
                                        prefix))


def _child(model_name: str) -> None:
    """The Linux CPU run of the job read from stdin (`_run`); the result as one JSON line."""
    torch.set_num_threads(1)
    from .checkpoint import load_model

    job = json.loads(sys.stdin.read())
    print(json.dumps(_run(load_model(model_name), "rlimit", **job)))


if __name__ == "__main__":
    _child(sys.argv[1])
