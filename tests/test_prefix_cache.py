"""Stage 6: block hashes, the prefix cache's hit and miss paths, LRU eviction order, salts,
collisions, forks, preemption, and the bookkeeping invariant under random operations."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.paged import KVCacheManager, NoFreeBlocksError, PagedKVCache, RequestTooLongError
from kvlab.prefix import (ROOT_HASH, PrefixCachingKVCacheManager, extra_keys_for, hash_block,
                          hash_full_blocks)


def constant_hash(data: bytes) -> bytes:
    """The weakest hash there is: every block of every prompt collides."""
    return b"\x00"


def free_order(manager) -> list[int]:
    return [block.block_id for block in manager.pool.free_queue]


# ---- hashing ----------------------------------------------------------------------------------

def test_block_hash_is_sha256_of_parent_tokens_and_extra_keys():
    expected = hashlib.sha256(ROOT_HASH + b"|1,2,3,4|()").digest()
    assert hash_block(None, [1, 2, 3, 4]) == expected
    child = hash_block(expected, [5, 6, 7, 8], ("salt", "a"))
    assert child == hashlib.sha256(expected + b"|5,6,7,8|('salt', 'a')").digest()


def test_hash_chain_covers_the_whole_prefix_and_only_full_blocks():
    first = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(first) == 2  # the partial block (token 9) has no hash
    other = hash_full_blocks([0, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    # Same tokens in block 1, different block 0: block 1's hash differs (the parent is in it).
    assert first[1] != other[1]
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4) == first
    assert hash_full_blocks([1, 2, 3, 4], 4, extra_keys_for("a")) != first[:1]
    with pytest.raises(TypeError, match="cache_salt must be a string"):
        extra_keys_for(3)


# ---- hit and miss paths -----------------------------------------------------------------------

def test_hit_shares_the_prefix_blocks_and_prefill_starts_after_them():
    manager = PrefixCachingKVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))                           # 2 full blocks + 2 tokens
    first = manager.allocate_with_prefix("a", prompt)
    assert first.num_cached_tokens == 0 and len(first.slots) == 10
    second = manager.allocate_with_prefix("b", prompt[:8] + [50, 51, 52])
    assert second.num_cached_tokens == 8 and second.hit_block_ids == manager.block_ids("a")[:2]
    assert [manager.pool.ref_count(b) for b in second.hit_block_ids] == [2, 2]
    block = manager.block_ids("b")[2]
    assert second.slots == [block * 4, block * 4 + 1, block * 4 + 2]  # positions 8, 9, 10
    stats = manager.prefix_stats
    assert (stats.num_query_tokens, stats.num_hit_tokens, stats.num_hit_blocks) == (21, 8, 2)
    assert stats.hit_rate == pytest.approx(8 / 21) and stats.prefill_tokens_skipped == 8


def test_hit_cap_leaves_at_least_one_prompt_token_to_compute():
    manager = PrefixCachingKVCacheManager(num_blocks=12, block_size=4)
    manager.allocate_with_prefix("a", list(range(13)))
    manager.free("a")
    for length, expected in ((12, 8), (13, 12), (9, 8), (8, 4), (4, 0), (1, 0)):
        hits = manager.lookup(list(range(length)))
        assert len(hits) * 4 == expected, f"prompt of {length}"
    whole = manager.allocate_with_prefix("b", list(range(12)))  # cached entirely: redo block 2
    assert whole.num_cached_tokens == 8 and len(whole.slots) == 4


def test_a_free_cached_block_is_taken_back_out_of_the_free_queue():
    manager = PrefixCachingKVCacheManager(num_blocks=6, block_size=2)
    manager.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    manager.free("a")
    assert manager.block_counts() == {"free": 4, "cached": 2, "in_use": 0}
    hit = manager.allocate_with_prefix("b", [1, 2, 3, 4, 9])
    assert hit.hit_block_ids == [0, 1]
    assert 0 not in free_order(manager) and 1 not in free_order(manager)
    assert manager.block_counts() == {"free": 3, "cached": 0, "in_use": 3}


def test_failed_admission_changes_nothing():
    manager = PrefixCachingKVCacheManager(num_blocks=4, block_size=2)
    manager.allocate_with_prefix("a", [1, 2, 3, 4])
    manager.free("a")                                  # blocks 0, 1 cached and free
    manager.allocate_with_prefix("held", [7, 8, 9])    # takes 2 uncached blocks
    before = (free_order(manager), dict(manager.tables), manager.prefix_stats,
              len(manager.prefix_cache))
    # 1 hit (block 0, free) + 2 new = 3 free blocks needed, 2 are free.
    with pytest.raises(NoFreeBlocksError, match=r"needs 3 free blocks \(2 new \+ 1 cached"):
        manager.allocate_with_prefix("b", [1, 2, 5, 6, 7])
    assert before == (free_order(manager), dict(manager.tables), manager.prefix_stats,
                      len(manager.prefix_cache))
    assert manager.blocks_to_admit([1, 2, 5, 6, 7]) == 3 and not manager.can_admit([1, 2, 5, 6, 7])
    with pytest.raises(RequestTooLongError, match="9 tokens = 5 blocks of 2"):
        manager.allocate_with_prefix("c", list(range(9)))
    with pytest.raises(ValueError, match="needs the 1 new token ids"):
        manager.append_slots("held", 1)


def test_a_retried_admission_computes_no_hash():
    calls = []

    def counting_sha256(data: bytes) -> bytes:
        calls.append(data)
        return hashlib.sha256(data).digest()

    manager = PrefixCachingKVCacheManager(num_blocks=9, block_size=2, hash_fn=counting_sha256)
    manager.allocate_with_prefix("a", [1, 2, 3, 4, 5, 6, 7])   # 4 blocks, 3 full ones hashed
    manager.allocate_with_prefix("held", [20, 21, 22])         # 2 more: 3 blocks left free
    prompt = list(range(1, 16))                                # 7 full blocks + 1 token
    hashes: list[bytes] = []
    calls.clear()
    with pytest.raises(NoFreeBlocksError):                    # 3 hits + 5 new > 3 free
        manager.allocate_with_prefix("b", prompt, block_hashes=hashes)
    assert len(calls) == 4 and len(hashes) == 4               # blocks 0-2 hit, block 3 missed
    for _ in range(3):                                         # the queue retries its head
        with pytest.raises(NoFreeBlocksError):
            manager.allocate_with_prefix("b", prompt, block_hashes=hashes)
    assert len(calls) == 4                                     # no hash computed again
    manager.free("held")
    allocation = manager.allocate_with_prefix("b", prompt, block_hashes=hashes)
    assert allocation.num_cached_tokens == 6
    assert len(calls) == 7                                     # blocks 4-6, each once
    manager.append_slots("b", 1, [16])                         # fills block 7
    assert len(calls) == 8
    # The same chain as hashing from scratch; the cache keeps the hashes the list holds.
    assert hashes == hash_full_blocks(prompt + [16], 2)
    assert [manager.prefix_cache.entry(b).block_hash for b in manager.tables["b"].block_ids] \
        == hashes


# ---- eviction order ---------------------------------------------------------------------------

def test_a_finished_sequence_frees_its_tail_first():
    """Pins the stage-4 free order: releasing head first instead turns this red."""
    manager = KVCacheManager(num_blocks=5, block_size=2)
    manager.allocate("a", 6)                          # blocks 0 1 2
    manager.free("a")
    assert free_order(manager) == [3, 4, 2, 1, 0]     # 2 (the tail) is evicted first


def test_eviction_takes_the_tail_before_the_prefix_and_lru_across_requests():
    manager = PrefixCachingKVCacheManager(num_blocks=6, block_size=2)
    manager.allocate_with_prefix("a", [1, 2, 3, 4, 5, 6])   # blocks 0 1 2
    manager.allocate_with_prefix("b", [9, 9, 8, 8, 7])      # blocks 3 4 5
    manager.free("a")
    manager.free("b")
    assert free_order(manager) == [2, 1, 0, 5, 4, 3]
    manager.allocate_with_prefix("x", [40, 41])             # evicts a's tail block 2
    assert manager.prefix_stats.num_evictions == 1
    assert len(manager.lookup([1, 2, 3, 4, 5, 6, 0])) == 2  # a's prefix survives
    # A hit makes blocks recently used: b's prefix now outlives a's.
    manager.allocate_with_prefix("c", [9, 9, 8, 8, 0])      # hits 3 4, takes 1 (a's)
    manager.free("c")
    assert free_order(manager) == [0, 5, 1, 4, 3]
    manager.allocate_with_prefix("y", [60] * 5)             # takes 0 5 1
    assert len(manager.lookup([1, 2, 3, 4, 5])) == 0
    assert len(manager.lookup([9, 9, 8, 8, 0])) == 2


def test_a_recycled_block_never_gives_a_false_hit():
    manager = PrefixCachingKVCacheManager(num_blocks=3, block_size=2)
    manager.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    manager.free("a")
    manager.allocate_with_prefix("b", [7, 8, 9, 10, 11])   # reuses all three blocks
    manager.free("b")
    assert manager.prefix_stats.num_evictions == 2
    assert manager.lookup([1, 2, 3, 4, 5]) == []
    hits = manager.lookup([7, 8, 9, 10, 0])
    assert [entry.token_ids for entry in hits] == [(7, 8), (9, 10)]
    for entry in manager.prefix_cache.entries():        # no entry survives under an old hash
        assert manager.prefix_cache.knows_hash(entry.block_hash)
    assert len(manager.prefix_cache) == 2


def test_a_forced_collision_is_caught_by_the_token_check():
    checked = PrefixCachingKVCacheManager(num_blocks=8, block_size=2, hash_fn=constant_hash)
    checked.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    assert checked.allocate_with_prefix("c", [6, 7, 8]).num_cached_tokens == 0
    assert checked.prefix_stats.num_collisions == 1
    # Block 0 [6, 7] is cached now; a's block 1 holds [3, 4] too, but after [1, 2]: the parent
    # check refuses it, though its hash and its own tokens match.
    assert [e.token_ids for e in checked.lookup([6, 7, 3, 4, 0])] == [(6, 7)]
    trusting = PrefixCachingKVCacheManager(num_blocks=8, block_size=2, hash_fn=constant_hash,
                                           verify=False)
    trusting.allocate_with_prefix("a", [1, 2, 3, 4, 5])
    # vLLM's rule would hand c the K/V of a's tokens [1, 2], and then [3, 4] after them.
    assert trusting.allocate_with_prefix("c", [6, 7, 8]).num_cached_tokens == 2
    assert len(trusting.lookup([6, 7, 3, 4, 0])) == 2


def test_cache_salt_isolates_tenants():
    manager = PrefixCachingKVCacheManager(num_blocks=12, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    manager.allocate_with_prefix("a", prompt, cache_salt="tenant-a")
    assert manager.allocate_with_prefix("b", prompt, cache_salt="tenant-b").num_cached_tokens == 0
    assert manager.allocate_with_prefix("c", prompt).num_cached_tokens == 0
    assert manager.allocate_with_prefix("d", prompt, cache_salt="tenant-a").num_cached_tokens == 4


# ---- forks and preemption ---------------------------------------------------------------------

def test_fork_and_copy_on_write_keep_the_cache_exact():
    manager = PrefixCachingKVCacheManager(num_blocks=10, block_size=2)
    manager.allocate_with_prefix("p", [1, 2, 3])
    manager.fork("p", "c")
    parent = manager.append_slots("p", 1, [4])       # copy-on-write of the shared last block
    child = manager.append_slots("c", 1, [9])
    assert len(parent.copies) == 1 and child.copies == []
    assert [e.token_ids for e in manager.lookup([1, 2, 3, 4, 0])] == [(1, 2), (3, 4)]
    assert [e.token_ids for e in manager.lookup([1, 2, 3, 9, 0])] == [(1, 2), (3, 9)]
    manager.free("p")
    manager.free("c")
    assert manager.block_counts() == {"free": 7, "cached": 3, "in_use": 0}


def test_a_preempted_sequence_hits_its_own_freed_blocks():
    manager = PrefixCachingKVCacheManager(num_blocks=8, block_size=2)
    tokens = [5, 6, 7]
    manager.allocate_with_prefix("s", tokens)
    for token in (8, 9, 10):                          # decode fills block 1 and part of block 2
        manager.append_slots("s", 1, [token])
        tokens.append(token)
    assert manager.preempt("s") == 6
    again = manager.allocate_with_prefix("s", tokens)  # recompute prompt + output
    assert again.num_cached_tokens == 4 and len(again.slots) == 2


# ---- bookkeeping under random operations (hypothesis) -----------------------------------------

BLOCK = 2
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [1, 2, 8], [3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]


class PrefixManagerMachine(RuleBasedStateMachine):
    """Admit prompts that share prefixes, decode, fork, free, preempt on 8 blocks of 2 tokens."""

    def __init__(self):
        super().__init__()
        self.manager = PrefixCachingKVCacheManager(num_blocks=8, block_size=BLOCK)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(prompt=st.sampled_from(PROMPTS), salt=st.sampled_from([None, "s"]),
          tail=st.lists(st.integers(0, 3), max_size=3))
    def admit(self, prompt, salt, tail):
        tokens, before = prompt + tail, self.manager.block_counts()
        try:
            result = self.manager.allocate_with_prefix(self.next_id, tokens, salt)
        except NoFreeBlocksError:
            assert self.manager.block_counts() == before
            return
        assert result.num_cached_tokens <= len(tokens) - 1
        self.tokens[self.next_id] = tokens
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        try:
            self.manager.append_slots(seq_id, len(new), new)
        except (NoFreeBlocksError, RequestTooLongError):
            return
        self.tokens[seq_id] += new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data, preempt):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        (self.manager.preempt if preempt else self.manager.free)(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def blocks_add_up_and_the_cache_is_exact(self):
        manager, cache = self.manager, self.manager.prefix_cache
        counts = manager.block_counts()
        assert counts["free"] + counts["cached"] + counts["in_use"] == 8
        held = Counter(b for table in manager.tables.values() for b in table.block_ids)
        assert all(block.ref_count == held[block.block_id] for block in manager.pool.blocks)
        live = {id(entry) for entry in cache.entries()}
        for entry in cache.entries():  # prefix-closed: a cached block's parent is cached too
            assert entry.parent is None or id(entry.parent) in live
        for seq_id, tokens in self.tokens.items():
            table = manager.tables[seq_id]
            assert table.num_tokens == len(tokens)
            for index in range(len(tokens) // BLOCK):  # every full block holds exactly its tokens
                entry = cache.entry(table.block_ids[index])
                assert entry is not None
                assert entry.token_ids == tuple(tokens[index * BLOCK:(index + 1) * BLOCK])


TestPrefixManagerMachine = PrefixManagerMachine.TestCase
TestPrefixManagerMachine.settings = settings(max_examples=200, stateful_step_count=50,
                                             deadline=None)


# ---- the model reads cached K/V at absolute positions -----------------------------------------

@pytest.fixture
def model(small_llama):  # tests/conftest.py's random GQA model (4 query / 2 KV heads, head_dim 8)
    return small_llama


@torch.no_grad()
def prefill(cache: PagedKVCache, model, seq_id, prompt, salt=None):
    """Admit with prefix caching, run the prompt from the hit on; -> (cached tokens, logits)."""
    admitted = cache.manager.allocate_with_prefix(seq_id, prompt, salt)
    start = admitted.num_cached_tokens
    store = cache.prefill_store(seq_id, torch.tensor(admitted.slots))
    logits = model(torch.tensor(prompt[start:]), torch.arange(start, len(prompt)), store)[-1]
    return start, logits


@torch.no_grad()
def greedy(cache: PagedKVCache, model, seq_id, prompt, new, salt=None):
    """Admit with prefix caching, prefill from the hit on, decode `new` tokens greedily."""
    manager = cache.manager
    start, logits = prefill(cache, model, seq_id, prompt, salt)
    out = [int(logits.argmax())]
    while len(out) < new:
        reservation = manager.append_slots(seq_id, 1, [out[-1]])
        for src, dst in reservation.copies:
            cache.copy_block(src, dst)
        store = cache.decode_store([seq_id], torch.tensor(reservation.slots))
        position = torch.tensor([len(prompt) + len(out) - 1])
        out.append(int(model(torch.tensor([out[-1]]), position, store)[0].argmax()))
    return start, out


@torch.no_grad()
def no_cache(model, prompt, new):
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(model(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt):]


def prefix_cache(model, num_blocks=24, **manager_options):
    cache = PagedKVCache.for_model(model, num_blocks, block_size=4)
    cache.manager = PrefixCachingKVCacheManager(num_blocks, 4, **manager_options)
    return cache


def test_hits_give_the_same_greedy_tokens_as_no_cache(model):
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 64, (9,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 64, (n,), generator=generator).tolist()
               for n in (0, 3, 7, 1)] + [shared[:8]]  # ragged; the first caches 2 blocks
    cache = prefix_cache(model)
    hits = []
    for seq_id, prompt in enumerate(prompts):
        cached, tokens = greedy(cache, model, seq_id, prompt, new=6)
        assert tokens == no_cache(model, prompt, 6), f"prompt {seq_id}"
        hits.append(cached)
    # The last prompt (8 tokens) is cached whole, so only block 0 is hit (the n - 1 cap).
    assert hits == [0, 8, 8, 8, 4]


def test_hit_on_decode_blocks_after_preemption_gives_the_same_tokens(model):
    prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = prefix_cache(model)
    _, first = greedy(cache, model, "s", prompt, new=7)   # 13 tokens: blocks 0-2 full
    cache.manager.preempt("s")
    resumed = prompt + first[:-1]                          # what the engine would recompute
    cached, rest = greedy(cache, model, "s", resumed, new=3)
    assert cached == 8                                     # 12 tokens, capped at 2 blocks
    assert [first[-1]] + rest[1:] == no_cache(model, prompt, 9)[6:9]
    assert rest == no_cache(model, resumed, 3)


def test_a_trusted_collision_returns_wrong_kv_and_the_check_prevents_it(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 5, 6]]
    with torch.no_grad():
        expected = model(torch.tensor(prompts[1]))[-1]
    for verify in (True, False):
        cache = prefix_cache(model, hash_fn=constant_hash, verify=verify)
        prefill(cache, model, "a", prompts[0])
        cached, logits = prefill(cache, model, "b", prompts[1])
        assert cached == (0 if verify else 4)
        # Trusting the hash, b attends over a's K/V for positions 0-3: its logits are wrong.
        assert torch.allclose(logits, expected, rtol=1e-4, atol=1e-5) == verify


# ---- generated shared-prefix workloads --------------------------------------------------------

def test_generated_workloads_share_what_their_parameters_say():
    from kvlab.prefix.workloads import (few_shot_workload, multi_turn_workload,
                                        system_prompt_workload)

    system = system_prompt_workload(num_requests=5, system_len=40, user_len=(3, 6), seed=1)
    assert system == system_prompt_workload(num_requests=5, system_len=40, user_len=(3, 6), seed=1)
    assert all(p[:40] == system.prompts[0][:40] and 43 <= len(p) <= 46 for p in system.prompts)
    shots = few_shot_workload(num_requests=3, instruction_len=4, num_shots=2, shot_len=6)
    assert all(p[:16] == shots.prompts[0][:16] for p in shots.prompts)
    chats = multi_turn_workload(num_chats=2, num_turns=3, system_len=8, answer_len=4)
    assert len(chats.prompts) == 6
    for earlier, later in zip(chats.prompts, chats.prompts[2:]):  # same chat, next turn
        assert later[:len(earlier)] == earlier
    with pytest.raises(ValueError, match="user_len must be"):
        system_prompt_workload(user_len=(5, 2))
    # Through the cache: every request after the first hits the system prompt's full blocks.
    manager = PrefixCachingKVCacheManager(num_blocks=64, block_size=16)
    for seq_id, prompt in enumerate(system.prompts):
        manager.allocate_with_prefix(seq_id, prompt)
    assert manager.prefix_stats.num_hit_tokens == 4 * 32  # 40 // 16 = 2 blocks, 4 requests
