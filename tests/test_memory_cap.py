"""kvlab.memory_cap: the naive reservation refused by a real cap, the engine served under it; what
counts as the allocator's refusal; the budget check where no cap can be set."""

from __future__ import annotations

import sys

import pytest
import torch

from kvlab.checkpoint import load_model
from kvlab.errors import KVCacheOutOfMemory
from kvlab.memory_cap import _run, refusal, run_under_cap
from kvlab.sizing import kv_bytes_per_token

MIB = 2**20


@pytest.fixture(scope="module")
def job():
    model = load_model("tiny", device="cpu")
    shared = list(range(3, 3 + 40))  # a 40-token prefix every prompt shares: two full blocks
    prompts = [shared + [100 + i, 200 + i] for i in range(8)]
    per_token = kv_bytes_per_token(model.config, model.dtype)
    room = len(prompts) * 1024 * per_token // 8  # the notebook's: an eighth of the naive slabs
    return model, prompts, room


def test_refusal_names_the_allocators_errors():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                       "allocate memory: you tried to allocate 8 bytes. Error code 12")
    assert refusal(cpu) == ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried "
                            "to allocate 8 bytes. Error code 12")
    assert refusal(MemoryError()) == "MemoryError"
    assert refusal(torch.OutOfMemoryError("CUDA out of memory.\nmore")) == (
        "OutOfMemoryError: CUDA out of memory.")
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as error:
            raise KVCacheOutOfMemory("KV cache reservation 8 seqs x ...") from error
    except KVCacheOutOfMemory as wrapped:
        assert refusal(wrapped) == ("torch.OutOfMemoryError -> KVCacheOutOfMemory: KV cache "
                                    "reservation 8 seqs x ...")
    assert refusal(RuntimeError("scheduler stuck")) is None  # not an allocator's refusal
    assert refusal(ValueError("can't allocate memory")) is None


def test_the_budget_check_where_no_cap_can_be_set(job):
    model, prompts, room = job
    run = _run(model, "budget", prompts, 4, 1024, room, 4 * room, 16)
    assert run["mechanism"] == "budget" and "budget check" in run["cap"]
    assert run["naive_refusal"].startswith("KVCacheOutOfMemory: KV cache reservation 8 seqs x "
                                           "1024 tokens x 2 KiB/token = 16 MiB > 2 MiB budget")
    assert run["num_blocks"] == room // (16 * 2048) == 64
    for name, prefix_caching in (("paged", False), ("prefix", True)):
        served = run[name]
        assert (served["prefix_caching"], served["finished"], served["refusal"]) == (
            prefix_caching, 8, None)
    # 8 requests of 42 + 4 tokens hold 3 blocks each; prefix caching stores the 2 shared once
    assert run["paged"]["peak_blocks_in_use"] == run["paged"]["peak_blocks_unshared"] == 24
    assert run["prefix"]["peak_blocks_in_use"] == 2 + 8 and run["prefix"]["peak_running"] == 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS: Linux only")
def test_a_real_cap_refuses_the_naive_slabs_and_serves_the_engine(job, monkeypatch):
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    model, prompts, room = job
    # 2 MiB of KV room + 5 MiB of headroom: the naive K tensor alone (8 MiB) cannot fit; the
    # engine's 2 MiB pool and its activations (under 1 MiB for 8 short prompts) can
    capped = run_under_cap(model, prompts, 4, 1024, room_bytes=room, headroom_bytes=5 * MIB)
    assert capped.mechanism == "rlimit" and "RLIMIT_AS" in capped.cap
    assert capped.naive_bytes == 16 * MIB
    assert "can't allocate memory" in capped.naive_refusal, capped.naive_refusal
    assert capped.paged.finished == capped.prefix.finished == 8
    assert capped.paged.refusal is None and capped.prefix.refusal is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS: Linux only")
def test_a_cap_too_small_for_the_engine_is_reported_not_hidden(job, monkeypatch):
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    model, prompts, room = job
    capped = run_under_cap(model, prompts, 4, 1024, room_bytes=room, headroom_bytes=0)
    # the 2 MiB pool needs room of its own beside the forward pass: not all of it fits in 2 MiB
    assert capped.naive_refusal is not None
    refused = [run.refusal for run in (capped.paged, capped.prefix) if run.refusal]
    assert refused and all("can't allocate memory" in text for text in refused), refused


def test_the_room_must_hold_one_request(job):
    model, prompts, _ = job
    with pytest.raises(ValueError, match=r"must hold one max_model_len=1024 request \(2,097,152 B"):
        run_under_cap(model, prompts, 4, 1024, room_bytes=MIB, headroom_bytes=0)
