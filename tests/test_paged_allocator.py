"""Stage 4 bookkeeping: free block queue, block pool, block tables, ref counts, copy-on-write,
preemption, start-up checks and exact byte accounting."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.config import PRESETS, LlamaConfig
from kvlab.paged import (Block, BlockPool, FreeBlockQueue, KVCacheManager, KVCacheOutOfMemory,
                         NoFreeBlocksError, PagedKVCache, RequestTooLongError, cdiv,
                         check_pool_fits, kv_block_bytes, num_blocks_for_budget, write_kv)

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=128, name="tiny")


# ---- free block queue -------------------------------------------------------------------------

def walk_backwards(queue: FreeBlockQueue) -> list[int]:
    ids, node = [], queue._tail.prev_free
    while node is not queue._head:
        ids.append(node.block_id)
        node = node.prev_free
    return ids[::-1]


queue_ops = st.lists(st.tuples(st.sampled_from(["pop", "append", "remove"]), st.integers(0, 7)),
                     max_size=40)


@settings(max_examples=200, deadline=None)
@given(initially_free=st.integers(0, 8), ops=queue_ops)
def test_free_queue_matches_a_list_model(initially_free, ops):
    blocks = [Block(i) for i in range(8)]
    queue = FreeBlockQueue(blocks[:initially_free])
    model = list(range(initially_free))
    for op, block_id in ops:
        block = blocks[block_id]
        if op == "pop":
            if model:
                assert queue.popleft().block_id == model.pop(0)
            else:
                with pytest.raises(IndexError):
                    queue.popleft()
        elif op == "append":
            if block_id in model:
                with pytest.raises(ValueError, match="already"):
                    queue.append(block)
            else:
                queue.append(block)
                model.append(block_id)
        else:
            if block_id in model:
                queue.remove(block)
                model.remove(block_id)
            else:
                with pytest.raises(ValueError, match="not in"):
                    queue.remove(block)
        assert [b.block_id for b in queue] == model == walk_backwards(queue)
        assert len(queue) == len(model)
        assert all((b in queue) == (b.block_id in model) for b in blocks)


def test_block_repr_does_not_walk_the_links():
    queue = FreeBlockQueue([Block(0), Block(1)])
    assert repr(next(iter(queue))) == "Block(block_id=0, ref_count=0)"


# ---- block pool ---------------------------------------------------------------------------------

def test_pool_allocates_from_the_head_and_frees_to_the_tail():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.release([1, 0])
    assert [b.block_id for b in pool.free_queue] == [2, 3, 1, 0]  # LRU: freed last, reused last
    with pytest.raises(NoFreeBlocksError, match="asked for 5 blocks, only 4 of 4"):
        pool.allocate(5)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="double free"):
        pool.release([2])
    with pytest.raises(ValueError, match="free"):
        pool.share(2)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


# ---- the KV cache manager, driven by random operation sequences -------------------------------

def snapshot(manager: KVCacheManager):
    tables = sorted((repr(s), tuple(t.block_ids), t.num_tokens) for s, t in manager.tables.items())
    refs = tuple(b.ref_count for b in manager.pool.blocks)
    free = tuple(b.block_id for b in manager.pool.free_queue)
    return tables, refs, free, manager.num_cow_copies


def check_invariants(manager: KVCacheManager) -> None:
    pool, size = manager.pool, manager.block_size
    held = Counter(b for table in manager.tables.values() for b in table.block_ids)
    free = [b.block_id for b in pool.free_queue]
    assert free == walk_backwards(pool.free_queue)  # the links agree both ways
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert not set(free) & set(held), "a block is free and in a block table at once"
    assert len(free) + len(held) == pool.num_blocks, "free + in use != total"
    for block in pool.blocks:
        assert block.ref_count == held[block.block_id], f"ref count of block {block.block_id}"
    for table in manager.tables.values():
        assert len(table.block_ids) == cdiv(table.num_tokens, size)  # no block before it is needed
        assert len(set(table.block_ids)) == len(table.block_ids)
    # Waste: only last blocks have empty slots, so fewer than one block per sequence.
    empty = pool.num_used_blocks * size - manager.num_stored_tokens
    assert 0 <= empty <= len(manager.tables) * (size - 1)


class ManagerMachine(RuleBasedStateMachine):
    """allocate / append / fork / free / preempt on a pool of 8 blocks of 3 tokens."""

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(num_blocks=8, block_size=3)
        self.tokens: dict[int, int] = {}  # the model: tokens each live sequence holds
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    @rule(num_tokens=st.integers(1, 8) | st.integers(9, 27))
    def allocate(self, num_tokens):
        seq_id, before = self._new_id(), snapshot(self.manager)
        free = self.manager.num_free_blocks
        try:
            slots = self.manager.allocate(seq_id, num_tokens)
        except (NoFreeBlocksError, RequestTooLongError):
            assert snapshot(self.manager) == before, "a failed allocation changed state"
            assert cdiv(num_tokens, 3) > free
            return
        assert len(set(slots)) == len(slots) == num_tokens
        assert self.manager.num_free_blocks == free - cdiv(num_tokens, 3)
        self.tokens[seq_id] = num_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_new=st.integers(1, 7))
    def append(self, data, num_new):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before, needed = snapshot(self.manager), self.manager.blocks_needed(seq_id, num_new)
        free = self.manager.num_free_blocks
        try:
            reservation = self.manager.append_slots(seq_id, num_new)
        except (NoFreeBlocksError, RequestTooLongError):
            assert snapshot(self.manager) == before, "a failed append changed state"
            assert needed > free or cdiv(self.tokens[seq_id] + num_new, 3) > 8
            return
        assert self.manager.num_free_blocks == free - needed
        table = self.manager.tables[seq_id]
        # Copy-on-write: every slot written now is in a block no other sequence holds.
        for slot in reservation.slots:
            assert self.manager.pool.ref_count(slot // 3) == 1
            assert slot // 3 in table.block_ids
        for src, dst in reservation.copies:  # the old last block was replaced by its copy
            assert table.block_ids[(self.tokens[seq_id] - 1) // 3] == dst
            assert src not in table.block_ids
        self.tokens[seq_id] += num_new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, free = self._new_id(), self.manager.num_free_blocks
        self.manager.fork(parent, child)
        assert self.manager.num_free_blocks == free  # sharing costs no block
        assert self.manager.block_ids(child) == self.manager.block_ids(parent)
        self.tokens[child] = self.tokens[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        assert self.manager.preempt(seq_id) == self.tokens.pop(seq_id)
        assert seq_id not in self.manager.tables

    # ---- invalid calls: each is refused with the value named, and changes nothing ----------

    BAD_COUNTS = st.integers(-30, -1) | st.sampled_from([1.5, True, "2", None])

    def _refused(self, call, match):
        before = snapshot(self.manager)
        with pytest.raises((ValueError, KeyError)) as info:
            call()
        assert re.search(match, str(info.value)), str(info.value)
        assert snapshot(self.manager) == before, "a refused call changed state"

    @rule(data=st.data(), bad=BAD_COUNTS)
    def append_a_bad_count(self, data, bad):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens) or [99]))
        if seq_id in self.tokens:
            self._refused(lambda: self.manager.append_slots(seq_id, bad), re.escape(repr(bad)))
        else:
            self._refused(lambda: self.manager.append_slots(seq_id, 1), "unknown sequence 99")

    @rule(bad=st.integers(-30, 0) | st.sampled_from([2.0, False, "3"]))
    def allocate_a_bad_count(self, bad):
        self._refused(lambda: self.manager.allocate(self.next_id + 1000, bad),
                      "num_tokens must be an integer >= 1")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def allocate_or_fork_onto_a_live_id(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._refused(lambda: self.manager.allocate(seq_id, 1), "already has a block table")
        self._refused(lambda: self.manager.fork(seq_id, seq_id), "already has a block table")

    @rule(seq_id=st.integers(1000, 1010))
    def free_fork_or_preempt_an_unknown_id(self, seq_id):
        for call in (self.manager.free, self.manager.preempt, self.manager.num_tokens,
                     lambda s: self.manager.fork(s, s + 100)):
            self._refused(lambda: call(seq_id), f"unknown sequence {seq_id}")

    @rule(block_id=st.integers(-10, -1) | st.integers(8, 20))
    def pool_calls_with_a_block_id_out_of_range(self, block_id):
        pool = self.manager.pool
        for call in (pool.share, pool.ref_count, lambda b: pool.release([b])):
            self._refused(lambda: call(block_id), rf"block_id must be an integer in \[0, 7\], "
                                                  rf"got {block_id}")

    @rule(data=st.data())
    def release_more_often_than_held(self, data):
        pool = self.manager.pool
        block_id = data.draw(st.integers(0, 7))
        times = pool.ref_count(block_id) + 1
        # The valid ids first: a partial release before the bad one would change state.
        ids = [b for b in range(8) if pool.ref_count(b) > 0 and b != block_id][:2] + [block_id] * times
        self._refused(lambda: pool.release(ids), f"block {block_id} is released {times}")

    @rule(bad=st.integers(-5, -1))
    def pool_allocate_a_negative_count(self, bad):
        self._refused(lambda: self.manager.pool.allocate(bad), f"got {bad}")

    @invariant()
    def bookkeeping_is_consistent(self):
        check_invariants(self.manager)
        assert {s: t.num_tokens for s, t in self.manager.tables.items()} == self.tokens

    def teardown(self):
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        assert self.manager.num_free_blocks == 8
        assert all(block.ref_count == 0 for block in self.manager.pool.blocks)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_blocks_are_taken_only_at_block_boundaries():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    assert manager.allocate("a", 4) == [0, 1, 2, 3]
    assert manager.num_used_blocks == 1
    assert manager.append_slots("a").slots == [4]  # position 4 crosses into a new block (1)
    for position in range(5, 8):
        assert manager.append_slots("a").slots == [4 + position - 4]
        assert manager.num_used_blocks == 2
    assert manager.append_slots("a", 2).slots == [8, 9]
    assert manager.block_ids("a") == [0, 1, 2]


def test_slot_mapping_through_a_non_contiguous_block_table():
    manager = KVCacheManager(num_blocks=6, block_size=2)
    manager.allocate("x", 2)              # block 0
    manager.allocate("y", 3)              # blocks 1, 2
    manager.free("x")                     # free queue: 3 4 5 0
    manager.append_slots("y", 3)          # y grows into 3 (position 4, 5)
    assert manager.block_ids("y") == [1, 2, 3]
    assert manager.append_slots("y", 2).slots == [4 * 2 + 0, 4 * 2 + 1]  # block 4
    assert manager.tables["y"].slot(3) == 2 * 2 + 1


def test_errors_name_the_numbers_and_change_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(RequestTooLongError, match=r"17 tokens = 5 blocks of 4.*pool of 4 blocks"):
        manager.allocate("long", 17)
    manager.allocate("a", 10)
    manager.allocate("b", 1)
    before = snapshot(manager)
    with pytest.raises(NoFreeBlocksError, match="needs 2 blocks.*0 of 4 are free"):
        manager.allocate("c", 5)
    with pytest.raises(NoFreeBlocksError, match="needs 1 blocks for 3 more tokens"):
        manager.append_slots("a", 3)
    assert snapshot(manager) == before and "c" not in manager.tables
    with pytest.raises(ValueError, match="already"):
        manager.allocate("a", 1)
    with pytest.raises(ValueError, match="already"):
        manager.fork("a", "a")


def test_format_block_tables_shows_sharing_and_the_free_queue():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    manager.allocate("a", 6)
    manager.fork("a", "b")
    text = manager.format_block_tables()
    assert "6 blocks: 2 used, 4 free, 2 shared" in text
    assert "[0* 1*]" in text and "last block 2/4 full" in text
    assert "free queue (head first): 2 3 4 5" in text
    manager.append_slots("b")  # copy-on-write: b gets block 2
    assert "'b'    7 tokens  [0* 2]" in manager.format_block_tables()


# ---- copy-on-write moves the bytes; siblings never see each other's tokens ---------------------

def fill(cache: PagedKVCache, slots: torch.Tensor, generator: torch.Generator) -> list:
    """Write random K/V for `slots` into every layer; returns what was written per layer."""
    written = []
    for layer in range(TINY.num_hidden_layers):
        key = torch.randn(len(slots), 2, 8, generator=generator)
        value = torch.randn(len(slots), 2, 8, generator=generator)
        write_kv(cache.k_caches[layer], cache.v_caches[layer], key, value, slots)
        written.append((key, value))
    return written


def gather_all(cache, seq_id):
    return [cache.gather(seq_id, layer) for layer in range(TINY.num_hidden_layers)]


def assert_same(left, right):
    for (k1, v1), (k2, v2) in zip(left, right):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_copy_on_write_keeps_siblings_bytes_apart():
    generator = torch.Generator().manual_seed(0)
    cache = PagedKVCache(TINY, num_blocks=8, block_size=4)
    fill(cache, cache.allocate("parent", 6), generator)  # blocks 0 (full) and 1 (2 of 4)
    parent_kv = gather_all(cache, "parent")
    cache.fork("parent", "child")
    assert cache.manager.num_used_blocks == 2            # the prompt is stored once
    assert_same(gather_all(cache, "child"), parent_kv)

    child_slot = cache.append_slots("child")             # lands in shared block 1: copy first
    assert cache.manager.num_cow_copies == 1
    assert cache.manager.block_ids("child")[0] == 0      # the full block stays shared
    assert cache.manager.block_ids("child")[1] != 1
    assert cache.manager.pool.ref_count(0) == 2 and cache.manager.pool.ref_count(1) == 1
    child_new = fill(cache, child_slot, generator)
    assert_same(gather_all(cache, "parent"), parent_kv)  # parent's bytes untouched
    for (k, v), (pk, pv), (nk, nv) in zip(gather_all(cache, "child"), parent_kv, child_new):
        assert torch.equal(k, torch.cat([pk, nk])) and torch.equal(v, torch.cat([pv, nv]))

    child_kv = gather_all(cache, "child")
    parent_slot = cache.append_slots("parent")           # ref count 1 now: write in place
    assert cache.manager.num_cow_copies == 1
    assert int(parent_slot) == 1 * 4 + 2
    fill(cache, parent_slot, generator)
    assert_same(gather_all(cache, "child"), child_kv)    # child's bytes untouched

    cache.free("parent")
    cache.free("child")
    assert cache.manager.num_free_blocks == 8


def test_fork_at_a_full_block_needs_no_copy():
    cache = PagedKVCache(TINY, num_blocks=4, block_size=4)
    cache.allocate("a", 4)
    cache.fork("a", "b")
    cache.append_slots("b")
    assert cache.manager.num_cow_copies == 0
    assert cache.manager.block_ids("b") == [0, 1]


# ---- start-up checks and exact bytes ------------------------------------------------------------

def test_pool_bytes_reserved_used_and_waste_are_exact():
    cache = PagedKVCache(TINY, num_blocks=10, block_size=4)
    per_token = 2 * 2 * 2 * 8 * 4  # K and V x layers x KV heads x head_dim x fp32 bytes
    assert cache.bytes_per_token == per_token
    assert cache.block_bytes == kv_block_bytes(TINY, 4) == 4 * per_token
    assert cache.pool_bytes == 10 * cache.block_bytes
    assert cache.reserved_bytes == cache.used_bytes == 0 and cache.waste == 0.0
    cache.allocate("a", 5)
    cache.allocate("b", 8)
    assert cache.reserved_bytes == 4 * cache.block_bytes
    assert cache.used_bytes == 13 * per_token
    assert cache.waste == pytest.approx(1 - 13 / 16)
    cache.fork("a", "c")  # shared: stored once, counted once
    assert cache.reserved_bytes == 4 * cache.block_bytes and cache.used_bytes == 13 * per_token


def test_block_bytes_of_a_published_config():
    # Llama-3.1-8B, bf16: 128 KiB per token, 16 tokens per block = 2 MiB per block.
    assert kv_block_bytes(PRESETS["llama-3.1-8b"], 16, torch.bfloat16) == 2 * 2**20


def test_num_blocks_for_budget():
    assert num_blocks_for_budget(10_000, 2_000, 1_000) == 8
    assert num_blocks_for_budget(10_000, 2_000, 1_000, activation_bytes=1_500) == 6
    with pytest.raises(KVCacheOutOfMemory, match=r"budget 1,000 B .* weights 2,000 B"):
        num_blocks_for_budget(1_000, 2_000, 100)
    with pytest.raises(KVCacheOutOfMemory, match="less than one block of 600 B"):
        num_blocks_for_budget(1_000, 500, 600)


def test_pool_too_small_for_max_model_len_fails_at_start_up():
    with pytest.raises(KVCacheOutOfMemory,
                       match=r"max_model_len=17 request needs 5 blocks of 4 tokens, the pool has "
                             r"4 blocks \(16 tokens\)"):
        PagedKVCache(TINY, num_blocks=4, block_size=4, max_model_len=17)
    check_pool_fits(4, 4, 16)  # exactly fits
