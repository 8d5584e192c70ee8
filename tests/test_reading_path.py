"""One request from `kvlab serve` to the forward pass and back stays short to read (issue 18's
target: at most 20 hops across at most 10 files of kvlab). Measured, not asserted by hand: the
kvlab frames on the stack at the deepest points a step reaches (the K/V written into the pool,
decode attention reading it, the scheduler's block allocation, the token handed back)."""

from __future__ import annotations

import sys
from pathlib import Path

import kvlab
from cli_run import run

ROOT = Path(kvlab.__file__).parent
KERNELS = Path(kvlab.__file__).parent.parent.parent / "kernels"
DEEPEST = {"write_kv", "decode_attention", "paged_prefill_attention", "allocate_slots",
           "update"}


def _kvlab_frames(frame) -> list[tuple[str, str]]:
    frames = []
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if ROOT in path.parents or KERNELS in path.parents:
            frames.append((path.name if ROOT not in path.parents else
                           str(path.relative_to(ROOT)), frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


def test_serve_to_the_forward_pass_and_back_is_short(capsys):
    stacks: dict[str, list] = {}

    def watch(frame, event, _arg):
        if event == "call" and frame.f_code.co_name in DEEPEST:
            stacks.setdefault(frame.f_code.co_name, _kvlab_frames(frame))

    sys.setprofile(watch)
    try:
        code, out, _ = run(capsys, "serve", "--trace", "azure-conv", "--strategy", "paged",
                           "--model", "tiny", "--num-requests", "2", "--device", "cpu",
                           "--kv-budget", "0.01")
    finally:
        sys.setprofile(None)
    assert code == 0, out
    assert {"write_kv", "decode_attention", "allocate_slots", "update"} <= set(stacks)
    files = {name for stack in stacks.values() for name, _ in stack}
    hops = {where: len(stack) - 1 for where, stack in stacks.items()}
    assert max(hops.values()) <= 20, hops
    assert len(files) <= 10, sorted(files)
