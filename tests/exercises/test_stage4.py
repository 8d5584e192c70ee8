"""Stage 4: the paged allocator, traced by hand and compared with `kvlab.paged.KVCacheManager`.

Grades `stage4_paged_allocator.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 4`.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from hypothesis import Phase, Verbosity, given, settings
from hypothesis import strategies as st

from kvlab.tools.grading import assert_equal, expect_raises
from kvlab.paged import BlockTable, KVCacheManager
from kvlab.errors import RequestTooLongError


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage4_paged_allocator.py")


def state(allocator):
    """Everything the allocator holds, as plain values (to compare before / after a call)."""
    return {"free_blocks": list(allocator.free_blocks),
            "ref_counts": list(allocator.ref_counts),
            "block_tables": {seq: list(table) for seq, table in allocator.block_tables.items()},
            "num_tokens": dict(allocator.num_tokens)}


def assert_unchanged(allocator, before, what):
    after = state(allocator)
    changed = [f"{name}: before {before[name]}, after {after[name]}"
               for name in before if after[name] != before[name]]
    assert not changed, (f"{what} raised, so it must change nothing, but it changed "
                         + "; ".join(changed))


def has_number(message, number):
    return re.search(rf"(?<![\d.]){number}(?![\d.])", message) is not None


# ---- slot_mapping -----------------------------------------------------------------------------

@pytest.mark.parametrize("table, positions, block_size, expected", [
    ([7, 2], [0, 3, 4, 5], 4, [28, 31, 8, 9]),
    ([0], [0, 1, 2], 16, [0, 1, 2]),
    ([3, 0, 5], [10, 2, 5], 4, [22, 14, 1]),
    ([9, 4, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8], 3, [27, 28, 29, 12, 13, 14, 3, 4, 5]),
])
def test_slot_mapping_by_hand(ex, table, positions, block_size, expected):
    assert_equal(ex.slot_mapping(table, positions, block_size), expected,
                 f"slot_mapping(block_table={table}, positions={positions}, "
                 f"block_size={block_size}) [slot = block_id * block_size + offset]")


def named(name):
    """A request as `KVCacheManager` needs it (its verbs read only request_id)."""
    return SimpleNamespace(request_id=name)


def test_slot_mapping_matches_kvlab_on_a_fragmented_table(ex):
    manager = KVCacheManager(num_blocks=6, block_size=4)
    manager.allocate_slots(named("a"), 8)   # blocks 0, 1
    manager.allocate_slots(named("b"), 4)   # block 2
    manager.allocate_slots(named("c"), 4)   # block 3
    manager.free(named("a"))
    manager.free(named("c"))
    manager.allocate_slots(named("d"), 17)  # blocks 4 5 1 0 3, out of order
    table = manager.block_ids("d")
    assert table == [4, 5, 1, 0, 3]
    slots = [4 * block + offset for block in table for offset in range(4)][:17]
    assert_equal(ex.slot_mapping(table, list(range(17)), 4), slots,
                 f"slot_mapping(block_table={table}, positions=range(17), block_size=4) [the "
                 f"slots of kvlab.paged.KVCacheManager's block table]")
    positions = [16, 0, 9, 3]
    reference = BlockTable(4, table, 17)
    assert_equal(ex.slot_mapping(table, positions, 4), [reference.slot(p) for p in positions],
                 f"slot_mapping(block_table={table}, positions={positions}, block_size=4) [as "
                 f"kvlab.paged.BlockTable.slot]")


@pytest.mark.parametrize("position", [8, 100, -1])
def test_slot_mapping_rejects_positions_without_a_block(ex, position):
    expect_raises(IndexError, lambda: ex.slot_mapping([5, 6], [0, position], 4),
                  f"slot_mapping(block_table=[5, 6], positions=[0, {position}], block_size=4) "
                  f"[the table holds positions 0 .. 7]")


# ---- allocate and append, traced by hand ------------------------------------------------------

def test_allocate_takes_whole_blocks_from_the_head(ex):
    allocator = ex.TinyBlockAllocator(10, 4)
    for seq, tokens, expected, free in (("a", 6, [0, 1], 8), ("b", 4, [2], 7),
                                        ("c", 1, [3], 6), ("d", 9, [4, 5, 6], 3)):
        what = f"TinyBlockAllocator(10, block_size=4) ... allocate({seq!r}, {tokens})"
        got = allocator.allocate(seq, tokens)
        assert_equal(got, expected, f"{what}: the returned block table")
        assert_equal(allocator.block_tables.get(seq), expected, f"{what}: block_tables[{seq!r}]")
        assert_equal(allocator.num_tokens.get(seq), tokens, f"{what}: num_tokens[{seq!r}]")
        assert_equal(allocator.num_free_blocks, free, f"{what}: num_free_blocks")
        for block in expected:
            assert_equal(allocator.ref_counts[block], 1, f"{what}: ref_counts[{block}]")


def test_append_takes_a_block_only_at_a_block_boundary(ex):
    allocator = ex.TinyBlockAllocator(10, 4)
    allocator.allocate("a", 6)
    # tokens after each append, and the table then: the 9th token opens block 2
    for tokens, table in ((7, [0, 1]), (8, [0, 1]), (9, [0, 1, 2]), (10, [0, 1, 2])):
        what = (f"TinyBlockAllocator(10, block_size=4), allocate('a', 6), append('a') to "
                f"{tokens} tokens")
        got = allocator.append("a")
        assert_equal(got, None, f"{what}: the return value (no sequence shares a block)")
        assert_equal(allocator.block_tables["a"], table, f"{what}: block_tables['a']")
        assert_equal(allocator.num_tokens["a"], tokens, f"{what}: num_tokens['a']")
        assert_equal(allocator.num_free_blocks, 10 - len(table), f"{what}: num_free_blocks")


# ---- fork, copy-on-write, free ----------------------------------------------------------------

def forked(ex, num_blocks=10, block_size=4, prompt=6):
    allocator = ex.TinyBlockAllocator(num_blocks, block_size)
    allocator.allocate("a", prompt)
    allocator.fork("a", "b")
    return allocator


def test_fork_shares_every_block(ex):
    allocator = forked(ex)
    what = "TinyBlockAllocator(10, block_size=4), allocate('a', 6), fork('a', 'b')"
    assert_equal(allocator.block_tables.get("b"), [0, 1], f"{what}: block_tables['b']")
    assert_equal(allocator.block_tables["a"], [0, 1], f"{what}: block_tables['a']")
    assert allocator.block_tables["b"] is not allocator.block_tables["a"], (
        f"{what}: block_tables['b'] is the same list object as block_tables['a']; the child needs "
        f"its own list (a copy-on-write changes one table, not both)")
    assert_equal(allocator.num_tokens.get("b"), 6, f"{what}: num_tokens['b']")
    assert_equal(allocator.ref_counts[:3], [2, 2, 0], f"{what}: ref_counts[:3]")
    assert_equal(allocator.num_free_blocks, 8, f"{what}: num_free_blocks (a fork takes no block)")


def test_copy_on_write_into_a_shared_partial_block(ex):
    allocator = forked(ex)  # a, b: 6 tokens in [0, 1]; block 1 holds 2 of 4 and is shared
    what = "TinyBlockAllocator(10, block_size=4), allocate('a', 6), fork('a', 'b'), append('b')"
    assert_equal(allocator.append("b"), (1, 2),
                 f"{what}: the return value (copy shared block 1 into fresh block 2: (src, dst))")
    assert_equal(allocator.block_tables["b"], [0, 2], f"{what}: block_tables['b']")
    assert_equal(allocator.block_tables["a"], [0, 1], f"{what}: block_tables['a'] (unchanged)")
    assert_equal(allocator.ref_counts[:3], [2, 1, 1], f"{what}: ref_counts[:3]")
    assert_equal(allocator.num_tokens["b"], 7, f"{what}: num_tokens['b']")
    assert_equal(allocator.num_free_blocks, 7, f"{what}: num_free_blocks")
    # Block 1 now belongs to 'a' alone: its next token needs no copy.
    what += ", append('a')"
    assert_equal(allocator.append("a"), None, f"{what}: the return value (block 1 is no longer "
                                              f"shared)")
    assert_equal(allocator.block_tables["a"], [0, 1], f"{what}: block_tables['a']")
    assert_equal(allocator.num_free_blocks, 7, f"{what}: num_free_blocks")


def test_no_copy_when_the_shared_last_block_is_full(ex):
    allocator = forked(ex, prompt=8)  # a, b: 8 tokens in [0, 1], both blocks full
    what = "TinyBlockAllocator(10, block_size=4), allocate('a', 8), fork('a', 'b'), append('b')"
    assert_equal(allocator.append("b"), None,
                 f"{what}: the return value (token 9 goes to a new block; full blocks are never "
                 f"written again, so sharing them needs no copy)")
    assert_equal(allocator.block_tables["b"], [0, 1, 2], f"{what}: block_tables['b']")
    assert_equal(allocator.ref_counts[:3], [2, 2, 1], f"{what}: ref_counts[:3]")


def test_free_returns_blocks_when_no_one_holds_them(ex):
    allocator = forked(ex)
    allocator.append("b")  # b: [0, 2], a: [0, 1]
    what = "allocate('a', 6), fork('a', 'b'), append('b') [b: [0, 2], a: [0, 1]], free('a')"
    allocator.free("a")
    assert_equal(allocator.ref_counts[:3], [1, 0, 1], f"{what}: ref_counts[:3]")
    assert_equal(allocator.num_free_blocks, 8,
                 f"{what}: num_free_blocks (block 1 comes back; block 0, still held by 'b', not)")
    assert "a" not in allocator.block_tables and "a" not in allocator.num_tokens, (
        f"{what}: 'a' is still in block_tables or num_tokens")
    what += ", free('b')"
    allocator.free("b")
    assert_equal(allocator.num_free_blocks, 10, f"{what}: num_free_blocks (everything is back)")
    assert_equal(allocator.ref_counts, [0] * 10, f"{what}: ref_counts")
    assert_equal(allocator.block_tables, {}, f"{what}: block_tables")


def test_freed_blocks_are_reused_last_tail_first(ex):
    allocator = ex.TinyBlockAllocator(4, 2)
    allocator.allocate("a", 5)  # [0, 1, 2]; free list [3]
    allocator.free("a")
    what = "TinyBlockAllocator(4, block_size=2), allocate('a', 5), free('a')"
    assert_equal(list(allocator.free_blocks), [3, 2, 1, 0],
                 f"{what}: free_blocks (freed blocks go to the right end, the sequence's last "
                 f"block first)")
    assert_equal(allocator.allocate("b", 8), [3, 2, 1, 0],
                 f"{what}, allocate('b', 8): the block table (taken from the left end)")


# ---- failures change nothing ------------------------------------------------------------------

def test_failed_allocate_changes_nothing(ex):
    allocator = ex.TinyBlockAllocator(4, 4)
    allocator.allocate("a", 8)  # 2 of 4 blocks left
    before = state(allocator)
    what = "TinyBlockAllocator(4, block_size=4), allocate('a', 8), allocate('b', 10)"
    error = expect_raises(MemoryError, lambda: allocator.allocate("b", 10),
                          what + " [needs 3 blocks, 2 are free]")
    assert_unchanged(allocator, before, what)
    message = str(error)
    assert has_number(message, 3) and has_number(message, 2), (
        f"{what}: the error message should say how many blocks are needed (3) and how many are "
        f"free (2); got {message!r}")
    assert_equal(allocator.allocate("b", 8), [2, 3],
                 f"{what}, then allocate('b', 8): the block table (the 2 free blocks)")


def test_failed_append_changes_nothing(ex):
    allocator = ex.TinyBlockAllocator(2, 4)
    allocator.allocate("a", 8)  # the whole pool, both blocks full
    before = state(allocator)
    what = ("TinyBlockAllocator(2, block_size=4), allocate('a', 8), append('a') [token 9 needs a "
            "block]")
    expect_raises(MemoryError, lambda: allocator.append("a"), what)
    assert_unchanged(allocator, before, what)


def test_failed_copy_on_write_changes_nothing(ex):
    allocator = forked(ex, num_blocks=2, prompt=6)  # a, b share [0, 1]; no block is free
    before = state(allocator)
    what = ("TinyBlockAllocator(2, block_size=4), allocate('a', 6), fork('a', 'b'), append('b') "
            "[the copy-on-write needs a block]")
    expect_raises(MemoryError, lambda: allocator.append("b"), what)
    assert_unchanged(allocator, before, what)


BAD_CALLS = {
    "allocate an existing sequence": (ValueError, lambda a: a.allocate("a", 3)),
    "allocate zero tokens": (ValueError, lambda a: a.allocate("z", 0)),
    "fork into an existing sequence": (ValueError, lambda a: a.fork("a", "a")),
    "fork an unknown parent": (KeyError, lambda a: a.fork("nobody", "c")),
    "append to an unknown sequence": (KeyError, lambda a: a.append("nobody")),
    "free an unknown sequence": (KeyError, lambda a: a.free("nobody")),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_raise_and_change_nothing(ex, case):
    error_type, call = BAD_CALLS[case]
    allocator = ex.TinyBlockAllocator(8, 4)
    allocator.allocate("a", 6)
    before = state(allocator)
    what = f"TinyBlockAllocator(8, block_size=4), allocate('a', 6), then: {case}"
    expect_raises(error_type, lambda: call(allocator), what)
    assert_unchanged(allocator, before, what)


# ---- the same operations on kvlab.paged.KVCacheManager ----------------------------------------

def check_invariants(allocator, what):
    """ref counts = how many tables hold each block; free list = the blocks nobody holds."""
    held = [0] * allocator.num_blocks
    for table in allocator.block_tables.values():
        for block in table:
            held[block] += 1
    assert_equal(list(allocator.ref_counts), held,
                 f"{what}: ref_counts (ref_counts[b] must be how many block tables hold b)")
    free = list(allocator.free_blocks)
    expected_free = sorted(b for b in range(allocator.num_blocks) if held[b] == 0)
    assert_equal(sorted(free), expected_free,
                 f"{what}: sorted(free_blocks) (exactly the blocks no table holds, each once)")
    used = sum(1 for count in held if count)
    assert_equal(allocator.num_free_blocks + used, allocator.num_blocks,
                 f"{what}: num_free_blocks + blocks in use (must be the pool's num_blocks)")


def replay(ex, num_blocks, block_size, operations):
    """Run `operations` on the learner's allocator and on KVCacheManager; compare after each."""
    mine = ex.TinyBlockAllocator(num_blocks, block_size)
    manager = KVCacheManager(num_blocks, block_size)
    done = []
    for op, *args in operations:
        done.append(f"{op}({', '.join(map(repr, args))})")
        what = (f"TinyBlockAllocator({num_blocks}, block_size={block_size}), "
                f"{', '.join(done)}")
        try:
            if op == "allocate":
                refused = manager.allocate_slots(named(args[0]), args[1]) is None
            elif op == "append":
                refused = manager.allocate_slots(named(args[0]), 1) is None
                copied = bool(manager.take_copies())
            elif op == "fork":
                refused = manager.fork(named(args[0]), named(args[1]))
            else:
                refused = manager.free(named(args[0]))
        except RequestTooLongError:
            refused = True
        if refused:
            before = state(mine)
            expect_raises(MemoryError, lambda: getattr(mine, op)(*args),
                          what + " [KVCacheManager has no free block for it]")
            assert_unchanged(mine, before, what)
            done[-1] += " (refused)"
            continue
        try:
            result = getattr(mine, op)(*args)
        except MemoryError as error:
            raise AssertionError(f"{what}: yours raised {type(error).__name__}: {error}, but "
                                 f"KVCacheManager had the blocks for it") from None
        if op == "append":
            assert_equal(result is not None, copied,
                         f"{what}: did append copy-on-write? (KVCacheManager: "
                         f"{'yes' if copied else 'no'}; yours returned {result!r})")
        assert_equal(mine.num_free_blocks, manager.num_free_blocks,
                     f"{what}: num_free_blocks [as KVCacheManager]")
        for seq in manager.tables:
            assert_equal(len(mine.block_tables.get(seq, [])), len(manager.block_ids(seq)),
                         f"{what}: blocks in block_tables[{seq!r}] [as KVCacheManager]")
            assert_equal(mine.num_tokens.get(seq), manager.num_tokens(seq),
                         f"{what}: num_tokens[{seq!r}] [as KVCacheManager]")
        check_invariants(mine, what)


def test_parallel_sampling_matches_kvlab(ex):
    # One prompt, three samples (n = 3), decoded until the pool runs dry, then one finishes.
    operations = [("allocate", "p", 6), ("fork", "p", "s1"), ("fork", "p", "s2")]
    for _ in range(3):
        operations += [("append", "p"), ("append", "s1"), ("append", "s2")]
    operations += [("append", "p"), ("free", "s1"), ("append", "p"), ("append", "s2"),
                   ("free", "p"), ("free", "s2")]
    replay(ex, 6, 4, operations)


OPERATION = st.tuples(st.sampled_from(["allocate", "append", "append", "fork", "free"]),
                      st.integers(0, 99), st.integers(1, 11))


# Quiet, one failure at a time, and no "explain" phase: the failure message itself lists the
# (shrunk) operations.
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          verbosity=Verbosity.quiet, report_multiple_bugs=False,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(steps=st.lists(OPERATION, min_size=1, max_size=25))
def test_random_operations_match_kvlab(ex, steps):
    # Turn the drawn steps into valid operations (on live sequences), tracked on a probe manager.
    probe, live, operations = KVCacheManager(6, 3), [], []
    for number, (op, pick, tokens) in enumerate(steps):
        if op == "allocate" or not live:
            operations.append(("allocate", f"s{number}", tokens))
            try:
                if probe.allocate_slots(named(f"s{number}"), tokens) is not None:
                    live.append(f"s{number}")
            except RequestTooLongError:
                pass
        elif op == "fork":
            operations.append(("fork", live[pick % len(live)], f"s{number}"))
            probe.fork(named(live[pick % len(live)]), named(f"s{number}"))
            live.append(f"s{number}")
        elif op == "free":
            operations.append(("free", live.pop(pick % len(live))))
            probe.free(named(operations[-1][1]))
        else:
            operations.append(("append", live[pick % len(live)]))
            try:
                probe.allocate_slots(named(live[pick % len(live)]), 1)
            except RequestTooLongError:
                pass
    replay(ex, 6, 3, operations)
