"""Stage 4 bookkeeping: free block queue, block pool, block tables, ref counts, copy-on-write,
preemption, start-up checks and exact byte accounting."""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

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
    # A cache hit's blocks are checked before any ref count moves: -1 would be the last block.
    before = [(b.block_id, b.ref_count) for b in pool.blocks], list(pool.free_queue)
    for bad in ([2, -1], [3, 4]):
        with pytest.raises(ValueError, match=r"block_id must be an integer in \[0, 3\]"):
            pool.touch(bad)
        with pytest.raises(ValueError, match=r"block_id must be an integer in \[0, 3\]"):
            pool.num_free_to_touch(bad)
    assert ([(b.block_id, b.ref_count) for b in pool.blocks], list(pool.free_queue)) == before


# ---- the KV cache manager, driven by random operation sequences -------------------------------

def seq(request_id):
    """The least a request must have for the plain manager's verbs."""
    return SimpleNamespace(request_id=request_id)


def new_slots(manager, request_id, num_new):
    """Slots of the newest `num_new` tokens of a request, from its block table."""
    table = manager.tables[request_id]
    return [table.slot(p) for p in range(table.num_tokens - num_new, table.num_tokens)]


def snapshot(manager: KVCacheManager):
    tables = sorted((repr(s), tuple(t.block_ids), t.num_tokens) for s, t in manager.tables.items())
    refs = tuple(b.ref_count for b in manager.pool.blocks)
    free = tuple(b.block_id for b in manager.pool.free_queue)
    return tables, refs, free, manager.num_cow_copies


def check_invariants(manager: KVCacheManager) -> None:
    pool, size = manager.pool, manager.block_size
    held = Counter(b for table in manager.tables.values() for b in table.block_ids)
    free = [b.block_id for b in pool.free_queue]
    if isinstance(pool.free_queue, FreeBlockQueue):  # stage 6's linked list: links agree both ways
        assert free == walk_backwards(pool.free_queue)
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
    """admit / append / fork / free (finish or preempt) on a pool of 8 blocks of 3 tokens."""

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
            blocks = self.manager.allocate_slots(seq(seq_id), num_tokens)
        except RequestTooLongError:
            blocks = None
        if blocks is None:
            assert snapshot(self.manager) == before, "a failed allocation changed state"
            assert cdiv(num_tokens, 3) > free
            return
        slots = new_slots(self.manager, seq_id, num_tokens)
        assert len(set(slots)) == len(slots) == num_tokens
        assert blocks == self.manager.block_ids(seq_id)
        assert self.manager.num_free_blocks == free - cdiv(num_tokens, 3)
        self.tokens[seq_id] = num_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_new=st.integers(1, 7))
    def append(self, data, num_new):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = snapshot(self.manager)
        old_table = self.manager.tables[seq_id]
        old_last = old_table.block_ids[-1]
        copy = self.tokens[seq_id] % 3 != 0 and self.manager.pool.ref_count(old_last) > 1
        needed = cdiv(self.tokens[seq_id] + num_new, 3) - len(old_table.block_ids) + copy
        free = self.manager.num_free_blocks
        try:
            blocks = self.manager.allocate_slots(seq(seq_id), num_new)
        except RequestTooLongError:
            blocks = None
            assert cdiv(self.tokens[seq_id] + num_new, 3) > 8
        if blocks is None:
            assert snapshot(self.manager) == before, "a failed append changed state"
            assert needed > free or cdiv(self.tokens[seq_id] + num_new, 3) > 8
            return
        assert len(blocks) == needed
        assert self.manager.num_free_blocks == free - needed
        table = self.manager.tables[seq_id]
        # Copy-on-write: every slot written now is in a block no other sequence holds.
        for slot in new_slots(self.manager, seq_id, num_new):
            assert self.manager.pool.ref_count(slot // 3) == 1
            assert slot // 3 in table.block_ids
        copies = self.manager.take_copies()
        assert len(copies) == copy
        for src, dst in copies:  # the old last block was replaced by its copy
            assert table.block_ids[(self.tokens[seq_id] - 1) // 3] == dst
            assert src not in table.block_ids
        self.tokens[seq_id] += num_new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, free = self._new_id(), self.manager.num_free_blocks
        self.manager.fork(seq(parent), seq(child))
        assert self.manager.num_free_blocks == free  # sharing costs no block
        assert self.manager.block_ids(child) == self.manager.block_ids(parent)
        self.tokens[child] = self.tokens[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq(seq_id))  # finished, or preempted: vLLM v1 preempts by free
        del self.tokens[seq_id]
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
            self._refused(lambda: self.manager.allocate_slots(seq(seq_id), bad),
                          re.escape(repr(bad)))
        else:  # a request without a table is being admitted: a bad count is refused as well
            self._refused(lambda: self.manager.allocate_slots(seq(99), bad),
                          re.escape(repr(bad)))

    @rule(bad=st.integers(-30, -1) | st.sampled_from([2.0, False, "3"]))
    def allocate_a_bad_count(self, bad):
        self._refused(lambda: self.manager.allocate_slots(seq(self.next_id + 1000), bad),
                      "num_new_tokens must be an integer >= 0")
        self._refused(lambda: self.manager.allocate_slots(seq(self.next_id + 1000), 0),
                      "admitted with no token")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def allocate_or_fork_onto_a_live_id(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._refused(lambda: self.manager.allocate_slots(seq(seq_id), 0, 3, [0]),
                      "already has a block table")
        self._refused(lambda: self.manager.fork(seq(seq_id), seq(seq_id)),
                      "already has a block table")

    @rule(seq_id=st.integers(1000, 1010))
    def free_or_fork_an_unknown_id(self, seq_id):
        for call in (lambda s: self.manager.free(seq(s)), self.manager.num_tokens,
                     lambda s: self.manager.fork(seq(s), seq(s + 100))):
            self._refused(lambda: call(seq_id), f"unknown request {seq_id}")

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
            self.manager.free(seq(seq_id))
        assert self.manager.num_free_blocks == 8
        assert all(block.ref_count == 0 for block in self.manager.pool.blocks)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_blocks_are_taken_only_at_block_boundaries():
    manager, a = KVCacheManager(num_blocks=4, block_size=4), seq("a")
    assert manager.allocate_slots(a, 4) == [0]
    assert new_slots(manager, "a", 4) == [0, 1, 2, 3]
    assert manager.num_used_blocks == 1
    assert manager.allocate_slots(a, 1) == [1]  # position 4 crosses into a new block (1)
    assert new_slots(manager, "a", 1) == [4]
    for position in range(5, 8):
        assert manager.allocate_slots(a, 1) == []
        assert new_slots(manager, "a", 1) == [4 + position - 4]
        assert manager.num_used_blocks == 2
    assert manager.allocate_slots(a, 2) == [2]
    assert new_slots(manager, "a", 2) == [8, 9]
    assert manager.block_ids("a") == [0, 1, 2]


def test_slot_mapping_through_a_non_contiguous_block_table():
    manager = KVCacheManager(num_blocks=6, block_size=2)
    x, y = seq("x"), seq("y")
    manager.allocate_slots(x, 2)              # block 0
    manager.allocate_slots(y, 3)              # blocks 1, 2
    manager.free(x)                           # free queue: 3 4 5 0
    manager.allocate_slots(y, 3)              # y grows into 3 (position 4, 5)
    assert manager.block_ids("y") == [1, 2, 3]
    assert manager.allocate_slots(y, 2) == [4]
    assert new_slots(manager, "y", 2) == [4 * 2 + 0, 4 * 2 + 1]  # block 4
    assert manager.tables["y"].slot(3) == 2 * 2 + 1


def test_errors_name_the_numbers_and_change_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(RequestTooLongError, match=r"17 tokens = 5 blocks of 4.*pool of 4 blocks"):
        manager.allocate_slots(seq("long"), 17)
    manager.allocate_slots(seq("a"), 10)
    manager.allocate_slots(seq("b"), 1)
    before = snapshot(manager)
    assert manager.allocate_slots(seq("c"), 5) is None      # no room now
    assert manager.allocate_slots(seq("a"), 3) is None
    assert snapshot(manager) == before and "c" not in manager.tables
    with pytest.raises(ValueError, match="already"):
        manager.allocate_slots(seq("a"), 1, 4, [3])
    with pytest.raises(ValueError, match="already"):
        manager.fork(seq("a"), seq("a"))
    with pytest.raises(ValueError, match="num_new_computed_tokens=3, but the 1 computed blocks"):
        manager.allocate_slots(seq("d"), 1, 3, [0])


def test_reject_reason_names_the_numbers():
    manager = KVCacheManager(num_blocks=4, block_size=4, max_model_len=12)
    request = SimpleNamespace(request_id=0, prompt_len=10, max_output_tokens=3, total_len=13)
    assert manager.reject_reason(request) == ("10 prompt + 3 output = 13 tokens > "
                                              "max_model_len=12")
    assert manager.reject_reason(SimpleNamespace(request_id=1, prompt_len=9, max_output_tokens=3,
                                                 total_len=12)) is None
    with pytest.raises(KVCacheOutOfMemory, match="max_model_len=17 request needs 5 blocks"):
        KVCacheManager(num_blocks=4, block_size=4, max_model_len=17)


def test_format_block_tables_shows_sharing_and_the_free_queue():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    manager.allocate_slots(seq("a"), 6)
    manager.fork(seq("a"), seq("b"))
    text = manager.format_block_tables()
    assert "6 blocks: 2 used, 4 free, 2 shared" in text
    assert "[0* 1*]" in text and "last block 2/4 full" in text
    assert "free queue (head first): 2 3 4 5" in text
    assert manager.allocate_slots(seq("b"), 1) == [2]  # copy-on-write: b gets block 2
    assert manager.take_copies() == [(1, 2)] and manager.take_copies() == []
    assert "'b'    7 tokens  [0* 2]" in manager.format_block_tables()
    assert manager.usage() == 3 / 6 and manager.num_reserved_tokens == 12


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


def grow(cache, seq_id, num_new):
    """Reserve `num_new` more slots (copy-on-write copied, as the model runner does); their slots."""
    cache.manager.allocate_slots(seq(seq_id), num_new)
    for src, dst in cache.manager.take_copies():
        cache.copy_block(src, dst)
    return cache.slot_mapping([seq_id], [num_new])


def gather_all(cache, seq_id):
    return [cache.gather(seq_id, layer) for layer in range(TINY.num_hidden_layers)]


def assert_same(left, right):
    for (k1, v1), (k2, v2) in zip(left, right):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_copy_on_write_keeps_siblings_bytes_apart():
    generator = torch.Generator().manual_seed(0)
    cache = PagedKVCache(TINY, num_blocks=8, block_size=4)
    fill(cache, grow(cache, "parent", 6), generator)  # blocks 0 (full) and 1 (2 of 4)
    parent_kv = gather_all(cache, "parent")
    cache.manager.fork(seq("parent"), seq("child"))
    assert cache.manager.num_used_blocks == 2            # the prompt is stored once
    assert_same(gather_all(cache, "child"), parent_kv)

    child_slot = grow(cache, "child", 1)                 # lands in shared block 1: copy first
    assert cache.manager.num_cow_copies == 1
    assert cache.manager.block_ids("child")[0] == 0      # the full block stays shared
    assert cache.manager.block_ids("child")[1] != 1
    assert cache.manager.pool.ref_count(0) == 2 and cache.manager.pool.ref_count(1) == 1
    child_new = fill(cache, child_slot, generator)
    assert_same(gather_all(cache, "parent"), parent_kv)  # parent's bytes untouched
    for (k, v), (pk, pv), (nk, nv) in zip(gather_all(cache, "child"), parent_kv, child_new):
        assert torch.equal(k, torch.cat([pk, nk])) and torch.equal(v, torch.cat([pv, nv]))

    child_kv = gather_all(cache, "child")
    parent_slot = grow(cache, "parent", 1)               # ref count 1 now: write in place
    assert cache.manager.num_cow_copies == 1
    assert int(parent_slot) == 1 * 4 + 2
    fill(cache, parent_slot, generator)
    assert_same(gather_all(cache, "child"), child_kv)    # child's bytes untouched

    cache.manager.free(seq("parent"))
    cache.manager.free(seq("child"))
    assert cache.manager.num_free_blocks == 8


def test_fork_at_a_full_block_needs_no_copy():
    cache = PagedKVCache(TINY, num_blocks=4, block_size=4)
    grow(cache, "a", 4)
    cache.manager.fork(seq("a"), seq("b"))
    grow(cache, "b", 1)
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
    grow(cache, "a", 5)
    grow(cache, "b", 8)
    assert cache.reserved_bytes == 4 * cache.block_bytes
    assert cache.used_bytes == 13 * per_token
    assert cache.waste == pytest.approx(1 - 13 / 16)
    cache.manager.fork(seq("a"), seq("c"))  # shared: stored once, counted once
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
