"""External fragmentation: the string pictures of `kvlab.paged.fragmentation`, and the exact-size
KV managers of `kvlab.serving.reservation` under the one scheduler.

Expected figures are worked out by hand in the comments.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.config import PRESETS
from kvlab.paged.block_table import cdiv
from kvlab.paged.fragmentation import first_fit, gaps_of, place
from kvlab.paged import KVCacheManager
from kvlab.serving import (CostModel, ExactBlocksManager, FirstFitSlabManager, Request,
                           SimulatedExecutor, from_sizes, get_card, serve)
from kvlab.workload import Request as Sizes


def test_first_fit_finds_the_first_big_enough_gap():
    memory = "AA..B...C"
    assert gaps_of(memory) == [(2, 2), (5, 3)] and gaps_of("..A.") == [(0, 2), (3, 1)]
    assert first_fit(gaps_of(memory), 1) == 2
    assert first_fit(gaps_of(memory), 2) == 2
    assert first_fit(gaps_of(memory), 3) == 5
    assert first_fit(gaps_of(memory), 4) is None


def test_place_fills_first_fit_and_refuses_when_only_scattered_slots_are_free():
    memory = place(place("." * 8, "A", 3), "B", 2)
    assert memory == "AAABB..."
    memory = place(memory.replace("A", "."), "C", 3)
    assert memory == "CCCBB..."
    with pytest.raises(ValueError, match="no gap of 4 free slots: 3 slots are free in total"):
        place(memory, "D", 4)
    with pytest.raises(ValueError, match="one character"):
        place(memory, "DD", 1)
    with pytest.raises(ValueError, match="size must be >= 1"):
        first_fit(gaps_of(memory), 0)


def request(request_id: int, total: int) -> Request:
    """A request that reserves exactly `total` slots (prompt total - 1, one output token)."""
    return Request(request_id, 0.0, prompt_len=total - 1, max_output_tokens=1)


def test_first_fit_places_each_run_in_the_lowest_gap_that_is_big_enough():
    kv = FirstFitSlabManager(capacity_tokens=12, max_model_len=12)
    a, b, c, d = request(0, 4), request(1, 3), request(2, 5), request(3, 2)
    for r in (a, b, c):
        assert kv.allocate_slots(r, 1) == []  # reserves the whole run whatever the count
    assert (kv.runs, kv.run_ends, kv.num_reserved_tokens) == ([0, 4, 7], [4, 7, 12], 12)
    kv.free(a)
    kv.free(c)
    assert kv.gaps() == [(0, 4), (7, 5)]
    kv.allocate_slots(d, 8)               # 2 slots: the first gap, at 0, although 7.. is bigger
    assert kv.runs == [0, 4] and kv.run_ends == [2, 7]
    kv.allocate_slots(request(4, 5), 8)   # 5 slots: the gap at 2 (2 slots) is too small; 7 .. 11
    assert kv.runs == [0, 4, 7] and kv.gaps() == [(2, 2)]
    assert kv.draw(width=12) == "##..########"
    assert kv.draw(width=4) == "++##"   # 3 slots a character: slots 0-2 and 3-5 partly free


def test_a_refusal_counts_as_a_gap_refusal_only_when_the_free_slots_add_up():
    kv = FirstFitSlabManager(capacity_tokens=10, max_model_len=10)
    a, b, big = request(0, 4), request(1, 4), request(2, 6)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 8)
    assert kv.allocate_slots(big, 8) is None      # 2 slots free in all: memory is simply full
    assert (kv.num_refusals, kv.num_gap_refusals, kv.worst_gap_refusal) == (1, 0, None)
    kv.free(a)                              # 6 free, as gaps of 4 (at 0) and 2 (at 8)
    assert kv.allocate_slots(big, 8) is None
    assert (kv.num_refusals, kv.num_gap_refusals, kv.free_at_gap_refusals) == (2, 1, 6)
    assert kv.gap_refused_requests == {2}
    worst = kv.worst_gap_refusal
    assert (worst.request_id, worst.size, worst.free_tokens, worst.gaps) == (2, 6, 6,
                                                                             [(0, 4), (8, 2)])
    assert worst.picture == kv.draw()


def test_a_refused_allocate_changes_nothing_but_the_counters():
    kv = FirstFitSlabManager(capacity_tokens=10, max_model_len=10)
    kv.allocate_slots(request(0, 3), 8)
    kv.allocate_slots(request(1, 4), 8)
    kv.free(request(0, 3))
    before = (list(kv.runs), list(kv.run_ends), list(kv.run_owners), kv.num_reserved_tokens)
    assert kv.allocate_slots(request(2, 5), 8) is None
    assert (list(kv.runs), list(kv.run_ends), list(kv.run_owners),
            kv.num_reserved_tokens) == before
    blocks = ExactBlocksManager(KVCacheManager(num_blocks=3, block_size=2), 6)
    blocks.allocate_slots(request(0, 4), 8)
    assert blocks.allocate_slots(request(1, 3), 8) is None   # 2 blocks wanted, 1 free
    assert (blocks.num_reserved_tokens, list(blocks.manager.tables)) == (4, [0])


def test_requests_that_can_never_fit_are_rejected_with_the_reason():
    kv = FirstFitSlabManager(capacity_tokens=10, max_model_len=12)
    assert "> 10 in the whole memory" in kv.reject_reason(request(0, 11))
    assert "max_model_len=12" in kv.reject_reason(request(1, 13))
    parent = request(2, 4)
    parent.forks = [request(3, 4)]
    assert "n = 2 completions" in kv.reject_reason(parent)
    assert kv.reject_reason(request(4, 10)) is None
    with pytest.raises(RuntimeError, match="never forks"):
        kv.fork(parent, parent.forks[0])
    short = FirstFitSlabManager(10, 10, reserve=lambda r: r.prompt_len)
    with pytest.raises(ValueError, match="gave request 5 3 token slots, fewer than the 4"):
        short.reject_reason(request(5, 4))
    with pytest.raises(ValueError, match="capacity_tokens >= 1"):
        FirstFitSlabManager(0, 10)
    # Blocks: the reservation rounds up to whole blocks, so 9 tokens need 5 blocks of 2 = 10 slots.
    blocks = ExactBlocksManager(KVCacheManager(num_blocks=4, block_size=2), 12)
    assert "reserves 10 token slots > 8" in blocks.reject_reason(request(6, 9))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(2, 12)), max_size=40))
def test_runs_stay_disjoint_inside_the_memory_and_first_fit_takes_the_lowest_gap(operations):
    kv = FirstFitSlabManager(capacity_tokens=24, max_model_len=24)
    held = []
    for request_id, (release, size) in enumerate(operations):
        if release and held:
            kv.free(held.pop(size % len(held)))
            continue
        gaps_before = kv.gaps()
        fits = [start for start, length in gaps_before if length >= size]
        r = request(request_id, size)
        result = kv.allocate_slots(r, 1)
        if fits:
            assert result == [] and kv.runs[kv.run_owners.index(request_id)] == fits[0]
            held.append(r)
        else:
            assert result is None and kv.gaps() == gaps_before
        ends = [0] + kv.run_ends
        assert all(end <= start for end, start in zip(ends, kv.runs))  # sorted, no overlap
        assert kv.num_reserved_tokens == sum(e - s for s, e in zip(kv.runs, kv.run_ends)) \
            == sum(r.total_len for r in held) <= 24


def trace(sizes):
    """Requests all queued at t = 0, from (prompt_len, output_len) pairs."""
    return from_sizes([Sizes(prompt, output) for prompt, output in sizes])


EXECUTOR = SimulatedExecutor(CostModel(PRESETS["llama-3.1-8b"], get_card("H100-80GB")))


def test_served_through_the_scheduler_slabs_wait_for_a_gap_and_blocks_do_not():
    # r0 reserves 3 + 1 = 4 slots, r1 1 + 3 = 4, r2 5 + 1 = 6; memory of 10 slots.
    # Slabs. Step 0: r0 -> 0-3, r1 -> 4-7; r2 refused with 2 free (not a gap refusal); r0
    # prefills and finishes; r1 prefills (output 1). Steps 1 and 2: r1 decodes (outputs 2, 3 and
    # finishes); r2 refused each time with 6 free in gaps of 4 and 2: two gap refusals.
    # Step 3: r2 -> 0-5, prefills, finishes. Running 2, 1, 1, 1.
    requests = trace([(3, 1), (1, 3), (5, 1)])
    slabs = FirstFitSlabManager(capacity_tokens=10, max_model_len=10)
    result = serve(requests, slabs, EXECUTOR)
    assert (result.num_steps, result.series.running) == (4, [2, 1, 1, 1])
    assert (slabs.num_refusals, slabs.num_gap_refusals, slabs.gap_refused_requests) == (3, 2, {2})
    # Blocks of 2, 5 of them: r2 needs 3 blocks, refused at step 0 (1 free); at step 1 r0's 2
    # blocks are back and r2 runs. Running 2, 2, 1 over 3 steps.
    blocks = ExactBlocksManager(KVCacheManager(num_blocks=5, block_size=2), 10)
    result = serve(requests, blocks, EXECUTOR)
    assert (result.num_steps, result.series.running) == (3, [2, 2, 1])


def test_a_replay_frees_everything_and_blocks_are_never_refused_for_gaps():
    sizes = [(7 * i % 23 + 1, 5 * i % 11 + 1) for i in range(60)]
    requests = trace(sizes)
    slabs = FirstFitSlabManager(capacity_tokens=64, max_model_len=64)
    slab_result = serve(requests, slabs, EXECUTOR)
    assert slab_result.finished == 60 and slab_result.preemptions == 0
    assert (slabs.runs, slabs.num_reserved_tokens) == ([], 0)       # all memory free again
    assert slabs.num_gap_refusals > 0                               # this workload fragments
    assert max(slab_result.series.reserved_tokens) <= 64

    class Watched(ExactBlocksManager):
        """Checks every refusal: fewer free blocks than the reservation needs, never a gap."""

        def admit(self, request):
            result = super().admit(request)
            if not result:
                needed = cdiv(request.total_len, self.block_size)
                assert self.manager.num_free_blocks < needed
            return result

    blocks = Watched(KVCacheManager(num_blocks=16, block_size=4), 64)
    block_result = serve(requests, blocks, EXECUTOR)
    assert block_result.finished == 60 and block_result.preemptions == 0
    assert blocks.manager.num_free_blocks == 16 and not blocks.manager.tables
    # Blocks on demand (stage 4's paging) on the same memory finish everything too.
    paged = KVCacheManager(num_blocks=16, block_size=4, max_model_len=64)
    assert serve(requests, paged, EXECUTOR).finished == 60
    assert paged.num_free_blocks == 16
