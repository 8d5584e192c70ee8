"""One request from `kvlab serve` to the forward pass and back stays short to read (issue 18's
target: at most 20 hops across at most 10 files of kvlab). Measured, not asserted by hand: the
kvlab frames on the stack at the deepest points a step reaches (the K/V written into the pool,
decode attention reading it, the scheduler's block allocation, the token handed back). And the
README's reading order of one simulated step names exactly the files such a step runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import kvlab
from cli_run import run
from kvlab.config import load_config
from kvlab.serving import (CostModel, Request, SchedulerConfig, SimulatedExecutor, get_card,
                           serve)
from kvlab.serving.strategies import paged_manager

ROOT = Path(kvlab.__file__).parent
KERNELS = Path(kvlab.__file__).parent.parent.parent / "kernels"
README = Path(kvlab.__file__).parent.parent.parent / "README.md"
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


def _readme_reading_order() -> tuple[set[str], set[str]]:
    """The files the README's reading order names: the paged step's, then prefix caching's."""
    section = README.read_text().split("### One scheduler step, in reading order", 1)[1]
    section = section.split("What a step does not run", 1)[0]
    paged, prefix = section.split("With prefix caching", 1)
    link = re.compile(r"\]\(src/kvlab/([\w/]+\.py)\)")
    return set(link.findall(paged)), set(link.findall(prefix))


def _files_a_step_runs(enable_prefix_caching: bool) -> set[str]:
    """kvlab's files with a function called inside `engine_step`, over a replay that shares
    prefixes, forks (n = 2), preempts and finishes."""
    requests = []
    for i in range(24):
        request = Request(i, 0.01 * i, 20 + 37 * (i % 5), 10 + 23 * (i % 3),
                          trace_block_ids=(1, 2, 100 + i), trace_block_size=16)
        if i % 6 == 0:
            request.forks = [Request(1000 + i, 0.01 * i, request.prompt_len, 12)]
        requests.append(request)
    files: set[str] = set()
    depth = 0

    def watch(frame, event, _arg):
        nonlocal depth
        if frame.f_code.co_name == "engine_step":
            depth += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and depth:
            path = Path(frame.f_code.co_filename)
            if ROOT in path.parents:
                files.add(str(path.relative_to(ROOT)))

    kv = paged_manager(40, 16, 512, enable_prefix_caching)
    executor = SimulatedExecutor(CostModel(load_config("llama-3.1-8b"), get_card("H100-80GB")))
    sys.setprofile(watch)
    try:
        result = serve(requests, kv, executor, SchedulerConfig(8, 128))
    finally:
        sys.setprofile(None)
    assert result.preemptions > 0 and result.finished == result.requests == 28
    if enable_prefix_caching:
        assert result.prefix_hit_rate > 0
    return files


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_the_readme_names_every_file_a_simulated_step_runs(enable_prefix_caching):
    paged, prefix = _readme_reading_order()
    expected = paged | prefix if enable_prefix_caching else paged
    assert _files_a_step_runs(enable_prefix_caching) == expected
