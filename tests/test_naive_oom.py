"""Stage 7 on a GPU, tested on the CPU: the naive strategy (one tensor per request, the allocator
decides) meets `torch.OutOfMemoryError`, reports the allocator's figures, and keeps serving the
other requests; the same traffic through paged + prefix completes with every block free again."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.errors import KVCacheOutOfMemory
from kvlab.generate import generate
from kvlab.model import LlamaForCausalLM
from kvlab.serving import Request, RequestState, SchedulerConfig, serve
from kvlab.tools.oom_story.allocator import AllocatorFigures, ByteLimit, OutOfMemoryReport
from kvlab.tools.oom_story.naive import NaiveExecutor, NaiveManager

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=128, name="test-tiny")
BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K and V x layers x KV heads x head_dim x float32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def burst(num=10, seed=5, max_prompt=30, max_output=10):
    """Requests that all arrive at once, with prompt ids."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt = rng.randint(1, max_prompt)
        out.append(Request(i, 0.0, prompt, rng.randint(1, max_output),
                           [rng.randrange(CONFIG.vocab_size) for _ in range(prompt)]))
    return out


def naive(limit_tokens, workspace_bytes=0, max_model_len=64):
    limit = ByteLimit(limit_tokens * BYTES_PER_TOKEN)
    manager = NaiveManager(CONFIG, torch.float32, "cpu", max_model_len, limit.limit_bytes,
                           workspace_bytes, allocator=limit)
    return manager, limit


def test_one_tensor_per_request_sized_for_prompt_plus_outputs(model):
    manager, limit = naive(10_000)
    request = burst(1)[0]
    assert manager.allocate_slots(request, 1) == []
    tensor = manager.kv[request.request_id]
    assert tuple(tensor.shape) == (2, 2, request.total_len, 2, 8)
    assert manager.num_reserved_tokens == request.total_len
    assert limit.live_bytes == request.total_len * BYTES_PER_TOKEN == manager.request_bytes(request)
    manager.free(request)
    assert limit.live_bytes == 0 and manager.kv == {}


def test_out_of_memory_is_caught_reported_and_the_others_finish(model):
    requests = burst(10)
    sizes = [r.total_len for r in requests]
    limit_tokens = sum(sorted(sizes)[:4]) + 3  # room for a few requests, never for all ten
    manager, limit = naive(limit_tokens)
    result = serve(requests, manager, NaiveExecutor(model, manager), SchedulerConfig(8, 64))

    assert result.finished == len(requests) and result.rejected == 0  # nobody was lost
    assert manager.reports, "the burst must hit the limit"
    first = manager.reports[0]
    assert isinstance(first, OutOfMemoryReport) and first.what == "KV cache"
    assert first.requested_bytes == sizes[first.request_id] * BYTES_PER_TOKEN
    figures = first.figures
    assert figures.allocated_bytes + first.requested_bytes > limit_tokens * BYTES_PER_TOKEN
    assert figures.most_servable_bytes == limit_tokens * BYTES_PER_TOKEN - figures.allocated_bytes
    assert first.requested_bytes > figures.most_servable_bytes  # the arithmetic of the message
    assert 1 <= first.num_running < len(requests)
    assert manager.max_running <= first.num_running < 8  # the cap fell below max_num_seqs
    assert manager.peak_running == result.peak_running <= first.num_running
    message = first.message()
    assert f"request {first.request_id}: KV cache for" in message
    assert f"{first.requested_bytes:,} B" in message and " > " in message
    assert f"with {first.num_running} requests running" in message
    assert limit.live_bytes == 0 and manager.kv == {}  # every tensor freed at the end

    served = {r.request_id: r for r in result.served_requests}
    for request in requests:  # the refused requests waited, then ran: tokens as generated alone
        solo = generate(model, request.prompt_token_ids, request.max_output_tokens,
                        cache="none").token_ids
        assert served[request.request_id].output_token_ids == solo, request.request_id


def test_a_refused_allocation_changes_nothing():
    manager, limit = naive(40)
    small, big = Request(0, 0.0, 20, 10), Request(1, 0.0, 5, 20)
    assert manager.allocate_slots(small, 1) == []
    before = (dict(manager.kv), limit.live_bytes, manager.num_reserved_tokens)
    assert manager.allocate_slots(big, 1) is None
    assert (dict(manager.kv), limit.live_bytes, manager.num_reserved_tokens) == before
    assert manager.max_running == 1 and len(manager.reports) == 1
    assert manager.allocate_slots(Request(2, 0.0, 1, 1), 1) is None  # the cap holds, no new report
    assert len(manager.reports) == 1
    manager.free(small)
    assert manager.allocate_slots(big, 1) == []  # after a finish, the waiting request gets in


def test_workspace_check_refuses_a_request_whose_forward_pass_would_not_fit():
    manager, limit = naive(40, workspace_bytes=10 * BYTES_PER_TOKEN)
    assert manager.allocate_slots(Request(0, 0.0, 10, 10), 1) == []      # 20 + 10 workspace <= 40
    assert manager.allocate_slots(Request(1, 0.0, 5, 10), 1) is None    # 35 fits, + 10 does not
    report = manager.reports[-1]
    assert report.what == "forward-pass workspace after its KV cache"
    assert report.requested_bytes == 10 * BYTES_PER_TOKEN
    assert limit.live_bytes == 20 * BYTES_PER_TOKEN and list(manager.kv) == [0]


def test_a_request_too_big_even_alone_is_rejected_on_arrival(model):
    manager, _ = naive(30)
    requests = [Request(0, 0.0, 25, 10, [1] * 25), Request(1, 0.0, 5, 3, [2] * 5)]
    reason = manager.reject_reason(requests[0])
    assert reason == (f"35 tokens x {BYTES_PER_TOKEN} B = {35 * BYTES_PER_TOKEN / 1024:g} KiB > "
                      f"{30 * BYTES_PER_TOKEN / 1024:g} KiB of KV memory even with nothing else "
                      f"running")
    result = serve(requests, manager, NaiveExecutor(model, manager), SchedulerConfig(4, 64))
    assert result.rejected == 1 and result.finished == 1


def test_out_of_memory_with_nothing_running_is_an_error_not_a_hang():
    manager, limit = naive(40)
    limit.live_bytes = 35 * BYTES_PER_TOKEN  # something else took the memory
    with pytest.raises(KVCacheOutOfMemory, match="cannot run at this limit"):
        manager.allocate_slots(Request(0, 0.0, 5, 5), 1)
    assert manager.kv == {} and manager.max_running is None


def test_monkeypatched_allocator_limit_on_torch_empty(model, monkeypatch):
    """The real allocation path (`torch.empty`), refused past N bytes the way CUDA would."""
    manager = NaiveManager(CONFIG, torch.float32, "cpu", 64, capacity_bytes=10**9)
    live, limit_bytes = [0], 60 * BYTES_PER_TOKEN
    real_new = NaiveManager.new_tensor

    def limited(self, shape, dtype):
        size = dtype.itemsize * torch.Size(shape).numel()
        if live[0] + size > limit_bytes:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        live[0] += size
        return real_new(self, shape, dtype)

    def dropped(self, tensor):
        live[0] -= tensor.numel() * tensor.element_size()

    monkeypatch.setattr(NaiveManager, "new_tensor", limited)
    monkeypatch.setattr(NaiveManager, "drop_tensor", dropped)
    figures = AllocatorFigures("fake", 1, 2, 1, 1, 3, 4)
    monkeypatch.setattr(NaiveManager, "figures", lambda self: figures)
    requests = burst(8, seed=9)
    result = serve(requests, manager, NaiveExecutor(model, manager), SchedulerConfig(8, 64))
    assert result.finished == 8 and manager.reports and live[0] == 0
    assert all(report.figures is figures for report in manager.reports)
    assert all(r.state is RequestState.FINISHED for r in result.served_requests)


def test_allocator_figures_arithmetic():
    figures = AllocatorFigures("x", allocated_bytes=70, reserved_bytes=100,
                               inactive_split_bytes=25, largest_free_block_bytes=20,
                               free_bytes=500, total_bytes=1000, limit_bytes=110)
    assert figures.reserved_unallocated_bytes == 30
    assert figures.new_segment_room_bytes == 10   # the process limit binds, not the device
    assert figures.most_servable_bytes == 20      # a cached block beats a new segment here
    assert AllocatorFigures("x", 0, 0, 0, 0, 5, 10).new_segment_room_bytes == 5  # no limit
    with pytest.raises(ValueError):
        ByteLimit(10, 11)


def test_cuda_figures_read_the_allocators_books(monkeypatch):
    """The figures are read from memory_stats / mem_get_info / memory_snapshot (faked here with
    the keys and shapes torch documents), the largest *inactive* block of this device counted."""
    from kvlab.tools.oom_story import allocator

    stats = {"allocated_bytes.all.current": 7 * 2**30, "reserved_bytes.all.current": 9 * 2**30,
             "inactive_split_bytes.all.current": 2**31 - 2**20, "num_ooms": 3}
    snapshot = [
        {"device": 0, "blocks": [{"size": 2**30, "state": "active_allocated"},
                                 {"size": 300 * 2**20, "state": "inactive"}]},
        {"device": 0, "blocks": [{"size": 500 * 2**20, "state": "inactive"},
                                 {"size": 2**20, "state": "active_pending_free"}]},
        {"device": 1, "blocks": [{"size": 4 * 2**30, "state": "inactive"}]},  # another card
    ]
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H200")
    figures = allocator.cuda_figures(torch.device("cuda", 0), limit_bytes=9 * 2**30 + 2**28)
    assert figures.source == "torch.cuda caching allocator on Fake H200"
    assert (figures.allocated_bytes, figures.reserved_bytes) == (7 * 2**30, 9 * 2**30)
    assert figures.reserved_unallocated_bytes == 2 * 2**30
    assert figures.inactive_split_bytes == 2**31 - 2**20 and figures.num_ooms == 3
    assert figures.largest_free_block_bytes == 500 * 2**20
    assert figures.new_segment_room_bytes == 2**28          # the limit binds, not the 100 GiB free
    assert figures.most_servable_bytes == 500 * 2**20
    report = OutOfMemoryReport(7, 4000, 96, "KV cache", 4096 * 131072, 57, figures, "It waits.")
    assert report.message() == (
        "request 7: KV cache for 4,000 prompt + 96 output = 4,096 tokens = 536,870,912 B "
        "(512 MiB) > 524,288,000 B (500 MiB), the most the allocator could hand out (largest "
        "free block in its reserved segments 500 MiB, room for a new segment 256 MiB), with 57 "
        "requests running; 2 GiB reserved but unallocated, 2 GiB of it in split blocks. It waits.")



def test_run_peaks_read_the_same_books(monkeypatch):
    """A run's peaks come from memory_stats too (faked with torch's documented keys)."""
    from kvlab.tools.oom_story import allocator

    stats = {"reserved_bytes.all.peak": 9 * 2**30, "inactive_split_bytes.all.peak": 2**29,
             "num_alloc_retries": 4, "num_ooms": 2, "reserved_bytes.all.current": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    assert allocator.run_peaks(torch.device("cuda", 0)) == {
        "reserved_bytes_peak": 9 * 2**30, "inactive_split_bytes_peak": 2**29,
        "num_alloc_retries": 4, "num_ooms": 2}

def test_sampling_through_the_naive_server_is_the_same_as_through_paged(model):
    """Seeded sampling and EOS come from the shared ModelRunner: the tokens of each request do
    not depend on the strategy, on the out-of-memory refusals or on who else is running."""
    from kvlab.sampling import stream_seed
    from kvlab.serving import SamplingParams, model_strategy

    requests = burst(10, seed=11, max_output=12)
    for index, request in enumerate(requests):
        request.sampling = SamplingParams(0.8, stream_seed("request", index, 0),
                                          stop_token_ids={7} if index % 3 == 0 else ())
    sizes = sorted(r.total_len for r in requests)
    manager, _ = naive(sizes[-1] + sizes[-2])  # each fits alone, never all ten together
    config = SchedulerConfig(8, 64)
    naive_result = serve(requests, manager, NaiveExecutor(model, manager), config)
    kv, executor = model_strategy("paged", model, 10_000 * BYTES_PER_TOKEN, 64, block_size=4)
    paged_result = serve(requests, kv, executor, config)
    assert manager.reports and naive_result.finished == paged_result.finished == len(requests)
    tokens = {r.request_id: r.output_token_ids for r in paged_result.served_requests}
    for request in naive_result.served_requests:
        assert request.output_token_ids == tokens[request.request_id], request.request_id
