"""kvlab.paged.fragmentation: first-fit memory strings and the toy FCFS `serve` of notebook 04.

Every expected figure is worked out by hand in the comments (one step = one scheduler step; a
request holds its reservation for decode_steps = max(output_len, 1) steps).
"""

import pytest

from kvlab.paged.fragmentation import ServeResult, first_fit, place, serve
from kvlab.workload import Request


def test_first_fit_finds_the_first_big_enough_gap():
    memory = "AA..B...C"
    assert first_fit(memory, 1) == 2
    assert first_fit(memory, 2) == 2
    assert first_fit(memory, 3) == 5
    assert first_fit(memory, 4) is None


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
        first_fit(memory, 0)


# r0 holds 4 tokens for 1 step, r1 4 tokens for 3 steps, r2 6 tokens for 1 step.
REQUESTS = [Request(prompt_len=3, output_len=1), Request(prompt_len=1, output_len=3),
            Request(prompt_len=5, output_len=1)]


def test_exact_slabs_wait_for_a_gap_although_enough_slots_are_free():
    # 10 slots. Step 0: r0 -> slots 0-3, r1 -> 4-7, r2 (6) waits: 2 free. Steps 1 and 2: r0 is
    # gone, 6 slots are free, but as gaps of 4 and 2: r2 waits "because of gaps" twice. Step 3:
    # r1 finishes, r2 -> 0-5. Step 4: r2 finishes. In flight 2, 1, 1, 1, 0 over 5 steps.
    result = serve(REQUESTS, memory_slots=10, reserve=lambda r: r.total_len)
    assert result == ServeResult(steps=5, mean_in_flight=1.0, waits_caused_by_gaps=2)


def test_blocks_take_any_free_ones():
    # 5 blocks of 2. Step 0: r0 (2 blocks), r1 (2); r2 (3) waits, 1 free. Step 1: r0 frees 2,
    # r2 takes 3. Step 2: r2 done. Step 3: r1 done. In flight 2, 2, 1, 0 over 4 steps.
    result = serve(REQUESTS, memory_slots=10, reserve=lambda r: r.total_len, block_size=2)
    assert result == ServeResult(steps=4, mean_in_flight=1.25, waits_caused_by_gaps=0)


def test_naive_max_model_len_slabs_serve_one_at_a_time():
    # Slabs of 8 in 10 slots: one request at a time, for 1 + 3 + 1 steps, then one empty step.
    result = serve(REQUESTS, memory_slots=10, reserve=lambda r: 8)
    assert result == ServeResult(steps=6, mean_in_flight=5 / 6, waits_caused_by_gaps=0)


def test_a_request_that_can_never_fit_is_refused_instead_of_waiting_forever():
    with pytest.raises(ValueError, match="request 2 reserves 6 tokens = 6 slots; the memory holds 1 .. 5"):
        serve(REQUESTS, memory_slots=5, reserve=lambda r: r.total_len)
    with pytest.raises(ValueError, match="request 2 reserves 6 tokens = 2 blocks of 4; the memory holds 1 .. 1"):
        serve(REQUESTS, memory_slots=7, reserve=lambda r: r.total_len, block_size=4)
    with pytest.raises(ValueError, match="memory_slots must be >= 1"):
        serve(REQUESTS, memory_slots=0, reserve=lambda r: 1)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        serve(REQUESTS, memory_slots=10, reserve=lambda r: 1, block_size=0)
    with pytest.raises(ValueError, match="no requests"):
        serve([], memory_slots=10, reserve=lambda r: 1)
