"""Stage 6: block hashes, the prefix cache's hit and miss paths, LRU eviction order, salts,
collisions, forks, preemption, and the bookkeeping invariant under random operations."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.paged import KVCacheManager, PagedKVCache, RequestTooLongError
from kvlab.prefix import (ROOT_HASH, PrefixCachingKVCacheManager, extra_keys_for, hash_block,
                          hash_full_blocks)
from kvlab.serving import Request


def constant_hash(data: bytes) -> bytes:
    """The weakest hash there is: every block of every prompt collides."""
    return b"\x00"


def free_order(manager) -> list[int]:
    return [block.block_id for block in manager.pool.free_queue]


def req(request_id, tokens, salt=None) -> Request:
    """A request whose prompt is `tokens` (real ids, as in model mode)."""
    return Request(request_id, 0.0, len(tokens), 64, list(tokens), cache_salt=salt)


def admit(manager, request, token_budget=None):
    """The scheduler's admission (get_computed_blocks, then allocate_slots): the tokens found
    cached, or None when refused (nothing changed)."""
    blocks, computed = manager.get_computed_blocks(request)
    num_new = request.num_tokens - computed
    if token_budget is not None:
        num_new = min(num_new, token_budget)
    return None if manager.allocate_slots(request, num_new, computed, blocks) is None else computed


def decode(manager, request, *tokens):
    """The request sampled `tokens`; reserve their slots (None: no room, nothing changed)."""
    request.output_token_ids += tokens
    request.num_output_tokens += len(tokens)
    new_blocks = None
    try:
        new_blocks = manager.allocate_slots(request, len(tokens))
    finally:
        if new_blocks is None:  # refused (or raised): the request did not grow
            del request.output_token_ids[-len(tokens):]
            request.num_output_tokens -= len(tokens)
    return new_blocks


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
    assert admit(manager, req("a", prompt)) == 0
    assert manager.num_tokens("a") == 10
    b = req("b", prompt[:8] + [50, 51, 52])
    blocks, computed = manager.get_computed_blocks(b)
    assert computed == 8 and blocks == manager.block_ids("a")[:2]
    assert manager.allocate_slots(b, 3, computed, blocks) == [manager.block_ids("b")[2]]
    assert manager.block_ids("b")[:2] == blocks
    assert [manager.pool.ref_count(b) for b in blocks] == [2, 2]
    stats = manager.prefix_stats
    assert (stats.num_query_tokens, stats.num_hit_tokens, stats.num_hit_blocks) == (21, 8, 2)
    assert stats.hit_rate == pytest.approx(8 / 21) and stats.prefill_tokens_skipped == 8


def test_hit_cap_leaves_at_least_one_prompt_token_to_compute():
    manager = PrefixCachingKVCacheManager(num_blocks=12, block_size=4)
    admit(manager, a := req("a", list(range(13))))
    manager.free(a)
    for length, expected in ((12, 8), (13, 12), (9, 8), (8, 4), (4, 0), (1, 0)):
        hits = manager.lookup(list(range(length)))
        assert len(hits) * 4 == expected, f"prompt of {length}"
        assert manager.get_computed_blocks(req(length, list(range(length))))[1] == expected
    assert admit(manager, req("b", list(range(12)))) == 8  # cached entirely: redo block 2
    assert manager.num_tokens("b") == 12


def test_a_free_cached_block_is_taken_back_out_of_the_free_queue():
    manager = PrefixCachingKVCacheManager(num_blocks=6, block_size=2)
    admit(manager, a := req("a", [1, 2, 3, 4, 5]))
    manager.free(a)
    assert manager.block_counts() == {"free": 4, "cached": 2, "in_use": 0}
    assert admit(manager, req("b", [1, 2, 3, 4, 9])) == 4
    assert manager.block_ids("b")[:2] == [0, 1]
    assert 0 not in free_order(manager) and 1 not in free_order(manager)
    assert manager.block_counts() == {"free": 3, "cached": 0, "in_use": 3}


def test_failed_admission_changes_nothing():
    manager = PrefixCachingKVCacheManager(num_blocks=4, block_size=2)
    admit(manager, a := req("a", [1, 2, 3, 4]))
    manager.free(a)                                    # blocks 0, 1 cached and free
    admit(manager, held := req("held", [7, 8, 9]))     # takes 2 uncached blocks
    before = (free_order(manager), dict(manager.tables), manager.prefix_stats,
              len(manager.prefix_cache))
    # 1 hit (block 0, free) + 2 new = 3 free blocks needed, 2 are free.
    b = req("b", [1, 2, 5, 6, 7])
    blocks, computed = manager.get_computed_blocks(b)
    assert (blocks, computed) == ([0], 2)
    assert manager.allocate_slots(b, 3, computed, blocks) is None
    assert before == (free_order(manager), dict(manager.tables), manager.prefix_stats,
                      len(manager.prefix_cache))
    with pytest.raises(RequestTooLongError, match="9 tokens = 5 blocks of 2"):
        admit(manager, req("c", list(range(9))))
    with pytest.raises(ValueError, match="not all cached"):
        manager.allocate_slots(req("d", [1, 2, 3]), 1, 2, [3])
    assert before == (free_order(manager), dict(manager.tables), manager.prefix_stats,
                      len(manager.prefix_cache))
    assert held.kv_block_hashes == hash_full_blocks([7, 8], 2)


def test_a_retried_admission_computes_no_hash():
    calls = []

    def counting_sha256(data: bytes) -> bytes:
        calls.append(data)
        return hashlib.sha256(data).digest()

    manager = PrefixCachingKVCacheManager(num_blocks=9, block_size=2, hash_fn=counting_sha256)
    admit(manager, req("a", [1, 2, 3, 4, 5, 6, 7]))    # 4 blocks, 3 full ones hashed
    admit(manager, held := req("held", [20, 21, 22]))  # 2 more: 3 blocks left free
    prompt = list(range(1, 16))                        # 7 full blocks + 1 token
    b = req("b", prompt)
    calls.clear()
    assert admit(manager, b) is None                   # 3 hits + 5 new > 3 free
    assert len(calls) == 4 and len(b.kv_block_hashes) == 4  # blocks 0-2 hit, block 3 missed
    for _ in range(3):                                 # the queue retries its head
        assert admit(manager, b) is None
    assert len(calls) == 4                             # no hash computed again
    manager.free(held)
    assert admit(manager, b) == 6
    assert len(calls) == 7                             # blocks 4-6, each once
    decode(manager, b, 16)                             # fills block 7
    assert len(calls) == 8
    # The same chain as hashing from scratch, kept on the request; the cache holds the same.
    assert b.kv_block_hashes == hash_full_blocks(prompt + [16], 2)
    assert [manager.prefix_cache.entry(x).block_hash for x in manager.tables["b"].block_ids] \
        == b.kv_block_hashes


def test_a_chunked_prefill_caches_each_block_as_its_chunk_fills_it():
    manager = PrefixCachingKVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])
    assert admit(manager, a, token_budget=3) == 0      # the first chunk: 3 of 7 tokens
    assert manager.num_tokens("a") == 3 and len(manager.prefix_cache) == 1
    assert manager.allocate_slots(a, 3) == [2]         # the next chunk needs no token ids
    assert manager.num_tokens("a") == 6 and len(manager.prefix_cache) == 3
    assert [e.token_ids for e in manager.lookup([1, 2, 3, 4, 5, 6, 0])] == [(1, 2), (3, 4),
                                                                         (5, 6)]


# ---- eviction order ---------------------------------------------------------------------------

def test_a_finished_sequence_frees_its_tail_first():
    """Pins the stage-4 free order: releasing head first instead turns this red."""
    manager = KVCacheManager(num_blocks=5, block_size=2)
    manager.allocate_slots(a := req("a", range(6)), 6)  # blocks 0 1 2
    manager.free(a)
    assert free_order(manager) == [3, 4, 2, 1, 0]     # 2 (the tail) is evicted first


def test_eviction_takes_the_tail_before_the_prefix_and_lru_across_requests():
    manager = PrefixCachingKVCacheManager(num_blocks=6, block_size=2)
    admit(manager, a := req("a", [1, 2, 3, 4, 5, 6]))   # blocks 0 1 2
    admit(manager, b := req("b", [9, 9, 8, 8, 7]))      # blocks 3 4 5
    manager.free(a)
    manager.free(b)
    assert free_order(manager) == [2, 1, 0, 5, 4, 3]
    admit(manager, req("x", [40, 41]))                  # evicts a's tail block 2
    assert manager.prefix_stats.num_evictions == 1
    assert len(manager.lookup([1, 2, 3, 4, 5, 6, 0])) == 2  # a's prefix survives
    # A hit makes blocks recently used: b's prefix now outlives a's.
    admit(manager, c := req("c", [9, 9, 8, 8, 0]))      # hits 3 4, takes 1 (a's)
    manager.free(c)
    assert free_order(manager) == [0, 5, 1, 4, 3]
    admit(manager, req("y", [60] * 5))                  # takes 0 5 1
    assert len(manager.lookup([1, 2, 3, 4, 5])) == 0
    assert len(manager.lookup([9, 9, 8, 8, 0])) == 2


def test_a_recycled_block_never_gives_a_false_hit():
    manager = PrefixCachingKVCacheManager(num_blocks=3, block_size=2)
    admit(manager, a := req("a", [1, 2, 3, 4, 5]))
    manager.free(a)
    admit(manager, b := req("b", [7, 8, 9, 10, 11]))   # reuses all three blocks
    manager.free(b)
    assert manager.prefix_stats.num_evictions == 2
    assert manager.lookup([1, 2, 3, 4, 5]) == []
    hits = manager.lookup([7, 8, 9, 10, 0])
    assert [entry.token_ids for entry in hits] == [(7, 8), (9, 10)]
    for entry in manager.prefix_cache.entries():        # no entry survives under an old hash
        assert manager.prefix_cache.knows_hash(entry.block_hash)
    assert len(manager.prefix_cache) == 2


def test_a_forced_collision_is_caught_by_the_token_check():
    checked = PrefixCachingKVCacheManager(num_blocks=8, block_size=2, hash_fn=constant_hash)
    admit(checked, req("a", [1, 2, 3, 4, 5]))
    assert admit(checked, req("c", [6, 7, 8])) == 0
    assert checked.prefix_stats.num_collisions == 1
    # Block 0 [6, 7] is cached now; a's block 1 holds [3, 4] too, but after [1, 2]: the parent
    # check refuses it, though its hash and its own tokens match.
    assert [e.token_ids for e in checked.lookup([6, 7, 3, 4, 0])] == [(6, 7)]
    trusting = PrefixCachingKVCacheManager(num_blocks=8, block_size=2, hash_fn=constant_hash,
                                           verify=False)
    admit(trusting, req("a", [1, 2, 3, 4, 5]))
    # vLLM's rule would hand c the K/V of a's tokens [1, 2], and then [3, 4] after them.
    assert admit(trusting, req("c", [6, 7, 8])) == 2
    assert len(trusting.lookup([6, 7, 3, 4, 0])) == 2


def test_cache_salt_isolates_tenants():
    manager = PrefixCachingKVCacheManager(num_blocks=12, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    admit(manager, req("a", prompt, "tenant-a"))
    assert admit(manager, req("b", prompt, "tenant-b")) == 0
    assert admit(manager, req("c", prompt)) == 0
    assert admit(manager, req("d", prompt, "tenant-a")) == 4


# ---- forks and preemption ---------------------------------------------------------------------

def test_fork_and_copy_on_write_keep_the_cache_exact():
    manager = PrefixCachingKVCacheManager(num_blocks=10, block_size=2)
    admit(manager, p := req("p", [1, 2, 3]))
    c = req("c", [1, 2, 3])
    manager.fork(p, c)
    assert c.kv_block_hashes == p.kv_block_hashes and c.kv_block_hashes is not p.kv_block_hashes
    assert len(decode(manager, p, 4)) == 1           # copy-on-write of the shared last block
    assert len(manager.take_copies()) == 1
    assert decode(manager, c, 9) == [] and manager.take_copies() == []
    assert [e.token_ids for e in manager.lookup([1, 2, 3, 4, 0])] == [(1, 2), (3, 4)]
    assert [e.token_ids for e in manager.lookup([1, 2, 3, 9, 0])] == [(1, 2), (3, 9)]
    manager.free(p)
    manager.free(c)
    assert manager.block_counts() == {"free": 7, "cached": 3, "in_use": 0}


def test_a_preempted_sequence_hits_its_own_freed_blocks():
    manager = PrefixCachingKVCacheManager(num_blocks=8, block_size=2)
    s = req("s", [5, 6, 7])
    admit(manager, s)
    for token in (8, 9, 10):                          # decode fills block 1 and part of block 2
        decode(manager, s, token)
    assert manager.num_tokens("s") == 6
    manager.free(s)                                   # preempted: vLLM v1 frees it
    assert admit(manager, s) == 4                     # recompute prompt + output
    assert manager.num_tokens("s") == 6


# ---- bookkeeping under random operations (hypothesis) -----------------------------------------

BLOCK = 2
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [1, 2, 8], [3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]


class PrefixManagerMachine(RuleBasedStateMachine):
    """Admit prompts that share prefixes, decode, fork, free, preempt on 8 blocks of 2 tokens."""

    def __init__(self):
        super().__init__()
        self.manager = PrefixCachingKVCacheManager(num_blocks=8, block_size=BLOCK)
        self.tokens: dict[int, list[int]] = {}
        self.requests: dict[int, Request] = {}
        self.next_id = 0

    @rule(prompt=st.sampled_from(PROMPTS), salt=st.sampled_from([None, "s"]),
          tail=st.lists(st.integers(0, 3), max_size=3))
    def admit(self, prompt, salt, tail):
        tokens, before = prompt + tail, self.manager.block_counts()
        request = req(self.next_id, tokens, salt)
        cached = admit(self.manager, request)
        if cached is None:
            assert self.manager.block_counts() == before
            return
        assert cached <= len(tokens) - 1
        self.tokens[self.next_id], self.requests[self.next_id] = tokens, request
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.manager.block_counts()
        try:
            new_blocks = decode(self.manager, self.requests[seq_id], *new)
        except RequestTooLongError:
            new_blocks = None
        if new_blocks is None:
            assert self.manager.block_counts() == before
            return
        self.tokens[seq_id] += new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[parent]
        child = req(self.next_id, tokens[:self.requests[parent].prompt_len])
        child.output_token_ids = list(self.requests[parent].output_token_ids)
        child.num_output_tokens = len(child.output_token_ids)
        self.manager.fork(self.requests[parent], child)
        self.tokens[self.next_id], self.requests[self.next_id] = list(tokens), child
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), readmit=st.booleans())
    def finish(self, data, readmit):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        request = self.requests.pop(seq_id)
        self.manager.free(request)  # finished, or preempted (then admitted again, maybe)
        tokens = self.tokens.pop(seq_id)
        if readmit and admit(self.manager, request) is not None:
            self.tokens[seq_id], self.requests[seq_id] = tokens, request

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
def prefill(cache: PagedKVCache, model, request):
    """Admit with prefix caching, run the tokens from the hit on; -> (cached tokens, logits)."""
    start = admit(cache.manager, request)
    tokens = request.token_ids(0, request.num_tokens)
    store = cache.batch_store([request.request_id], [len(tokens) - start])
    logits = model(torch.tensor(tokens[start:]), torch.arange(start, len(tokens)), store)[-1]
    return start, logits


@torch.no_grad()
def greedy(cache: PagedKVCache, model, request, new):
    """Admit with prefix caching, prefill from the hit on, decode `new` tokens greedily."""
    start, logits = prefill(cache, model, request)
    out = [int(logits.argmax())]
    while len(out) < new:
        decode(cache.manager, request, out[-1])
        for src, dst in cache.manager.take_copies():
            cache.copy_block(src, dst)
        store = cache.batch_store([request.request_id], [1])
        position = torch.tensor([request.num_tokens - 1])
        out.append(int(model(torch.tensor([out[-1]]), position, store)[0].argmax()))
    return start, out


@torch.no_grad()
def no_cache(model, prompt, new):
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(model(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt):]


def prefix_cache(model, num_blocks=24, **manager_options):
    manager = PrefixCachingKVCacheManager(num_blocks, 4, **manager_options)
    return PagedKVCache.for_model(model, num_blocks, block_size=4, manager=manager)


def test_hits_give_the_same_greedy_tokens_as_no_cache(model):
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 64, (9,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 64, (n,), generator=generator).tolist()
               for n in (0, 3, 7, 1)] + [shared[:8]]  # ragged; the first caches 2 blocks
    cache = prefix_cache(model)
    hits = []
    for seq_id, prompt in enumerate(prompts):
        cached, tokens = greedy(cache, model, req(seq_id, prompt), new=6)
        assert tokens == no_cache(model, prompt, 6), f"prompt {seq_id}"
        hits.append(cached)
    # The last prompt (8 tokens) is cached whole, so only block 0 is hit (the n - 1 cap).
    assert hits == [0, 8, 8, 8, 4]


def test_hit_on_decode_blocks_after_preemption_gives_the_same_tokens(model):
    prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = prefix_cache(model)
    _, first = greedy(cache, model, s := req("s", prompt), new=7)  # 13 tokens: blocks 0-2 full
    cache.manager.free(s)                                  # preempted
    resumed = prompt + first[:-1]                          # what the engine would recompute
    cached, rest = greedy(cache, model, req("s", resumed), new=3)
    assert cached == 8                                     # 12 tokens, capped at 2 blocks
    assert [first[-1]] + rest[1:] == no_cache(model, prompt, 9)[6:9]
    assert rest == no_cache(model, resumed, 3)


def test_a_trusted_collision_returns_wrong_kv_and_the_check_prevents_it(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 5, 6]]
    with torch.no_grad():
        expected = model(torch.tensor(prompts[1]))[-1]
    for verify in (True, False):
        cache = prefix_cache(model, hash_fn=constant_hash, verify=verify)
        prefill(cache, model, req("a", prompts[0]))
        cached, logits = prefill(cache, model, req("b", prompts[1]))
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
        admit(manager, req(seq_id, prompt))
    assert manager.prefix_stats.num_hit_tokens == 4 * 32  # 40 // 16 = 2 blocks, 4 requests
