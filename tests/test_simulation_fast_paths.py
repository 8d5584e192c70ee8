"""The simulation's hot paths written out for speed decide exactly as the plain code they replace:
the free queue's `popleft_many` is `popleft` k times, the prefix cache's `drop_all` is `drop` of
each block, and the scheduler's simulated decode step (no token ids) records what `_record_token`
records when the executor does return ids, step for step, on a slice of the Mooncake trace."""

from __future__ import annotations

import random

import pytest

from kvlab.paged.block_pool import Block
from kvlab.paged.free_queue import FreeBlockQueue
from kvlab.prefix.prefix_cache import PrefixCache
from kvlab.serving import (SchedulerConfig, SimulatedExecutor, from_sizes, serve, shrink,
                           simulated_manager, speed_up)
from kvlab.gpus import get_card
from kvlab.serving.cost_model import CostModel
from kvlab.config import load_config
from kvlab.traces import load_trace


def queue_with_holes(rng: random.Random) -> tuple[FreeBlockQueue, list[Block]]:
    blocks = [Block(i) for i in range(40)]
    queue = FreeBlockQueue(blocks)
    for block in rng.sample(blocks, 15):
        queue.remove(block)
    return queue, blocks


def test_popleft_many_takes_the_blocks_popleft_would_and_leaves_the_same_queue():
    rng = random.Random(0)
    for _ in range(50):
        seed = rng.random()
        many, _ = queue_with_holes(random.Random(seed))
        one, _ = queue_with_holes(random.Random(seed))
        count = rng.randrange(len(many) + 1)
        taken = many.popleft_many(count)
        assert [b.block_id for b in taken] == [one.popleft().block_id for _ in range(count)]
        assert [b.block_id for b in many] == [b.block_id for b in one]
        assert len(many) == len(one)
        assert all(b not in many and b.next_free is None for b in taken)
    with pytest.raises(IndexError, match="popleft of 26 blocks from a free block queue of 25"):
        queue_with_holes(random.Random(1))[0].popleft_many(26)


def test_drop_all_of_a_list_drops_as_one_block_at_a_time_does():
    def filled() -> PrefixCache:
        cache = PrefixCache()
        for block_id in range(12):  # hashes shared by pairs: buckets of two entries
            cache.insert_chain([block_id], [block_id // 2], [(block_id,)], (), None)
        return cache

    one, many = filled(), filled()
    asked = [3, 7, 2, 99, 3, 10]  # 99 is not cached; 3 is asked twice
    assert many.drop_all(asked) == sum(one.drop_all([block_id]) for block_id in asked) == 4
    assert [e.block_id for e in many.entries()] == [e.block_id for e in one.entries()]
    for block_hash in range(6):
        assert many.knows_hash(block_hash) == one.knows_hash(block_hash)


class TokenIdExecutor(SimulatedExecutor):
    """The simulated clock, but it returns a sampled id for every request that produced a token
    (the stand-in id of its outputs), so `Scheduler.update` takes its model-mode path."""

    def execute(self, output):
        _, seconds = super().execute(output)
        return {request.request_id: -1 - request.request_id
                for request, _ in output.scheduled}, seconds


@pytest.mark.parametrize("strategy", ["contiguous", "paged", "prefix"])
def test_simulated_decode_path_decides_as_the_token_path(strategy):
    requests = speed_up(shrink(from_sizes(load_trace("mooncake-conversation", limit=150)), 8), 20)
    cost = CostModel(load_config("llama-3.1-8b"), get_card("L4"))
    config = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)
    runs = [serve(requests, simulated_manager(strategy, 4000 * 100, 100, 2048), executor(cost),
                  config, 100, progress=False) for executor in (SimulatedExecutor,
                                                                 TokenIdExecutor)]
    fast, token_path = runs
    # Memory is short, so preemption and re-admission are on the path (a slab is never preempted).
    assert fast.finished > 100 and (fast.preemptions > 0 or strategy == "contiguous")
    assert fast.series == token_path.series
    assert [(r.first_token_s, r.finish_s, r.num_output_tokens, r.num_preemptions)
            for r in fast.served_requests] == [
        (r.first_token_s, r.finish_s, r.num_output_tokens, r.num_preemptions)
        for r in token_path.served_requests]
