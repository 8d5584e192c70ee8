"""Stage 4: fork and copy-on-write in a KV cache manager, traced by hand and replayed on
`kvlab.paged.KVCacheManager`.

Grades `stage4_paged_allocator.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 4`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import Phase, Verbosity, given, settings
from hypothesis import strategies as st

from kvlab.errors import RequestTooLongError
from kvlab.paged import KVCacheManager
from kvlab.tools.grading import assert_equal, expect_raises


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage4_paged_allocator.py")


def named(name):
    """A request as both managers need it (their verbs read only request_id)."""
    return SimpleNamespace(request_id=name)


def state(manager):
    """Everything the manager holds, as plain values (to compare before / after a call)."""
    return {"free_block_queue": list(manager.free_block_queue),
            "ref_counts": list(manager.ref_counts),
            "block_tables": {rid: list(table) for rid, table in manager.block_tables.items()},
            "num_tokens": dict(manager.num_tokens),
            "copies": list(manager.copies)}


def assert_unchanged(manager, before, what):
    after = state(manager)
    changed = [f"{name}: before {before[name]}, after {after[name]}"
               for name in before if after[name] != before[name]]
    assert not changed, f"{what} must change nothing, but it changed " + "; ".join(changed)


class Trace:
    """Calls on the learner's manager, remembered so that every message names the whole story."""

    def __init__(self, ex, num_blocks=10, block_size=4):
        self.manager = ex.ForkingKVCacheManager(num_blocks, block_size)
        self.calls = [f"ForkingKVCacheManager({num_blocks}, block_size={block_size})"]

    @property
    def what(self):
        return ", ".join(self.calls)

    def allocate_slots(self, name, num_new_tokens):
        self.calls.append(f"allocate_slots({name!r}, {num_new_tokens})")
        return self.manager.allocate_slots(named(name), num_new_tokens)

    def fork(self, parent, child):
        self.calls.append(f"fork({parent!r}, {child!r})")
        return self.manager.fork(named(parent), named(child))

    def free(self, name):
        self.calls.append(f"free({name!r})")
        return self.manager.free(named(name))

    def take_copies(self):
        self.calls.append("take_copies()")
        return self.manager.take_copies()

    def expect(self, **attributes):
        for name, expected in attributes.items():
            got = getattr(self.manager, name)
            got = list(got) if name == "free_block_queue" else got
            assert_equal(got, expected, f"{self.what}: {name}")


def forked(ex, num_blocks=10, block_size=4, prompt=6):
    """'a' holds `prompt` tokens and 'b' is forked from it."""
    trace = Trace(ex, num_blocks, block_size)
    trace.allocate_slots("a", prompt)
    trace.fork("a", "b")
    return trace


# ---- the page's manager, kept -----------------------------------------------------------------

def test_without_forks_it_is_the_page_manager(ex):
    trace = Trace(ex, 6, 4)
    assert_equal(trace.allocate_slots("a", 6), [0, 1], f"{trace.what}: the blocks taken")
    assert_equal(trace.allocate_slots("a", 2), [], f"{trace.what}: the blocks taken (block 1 "
                                                   f"had room for tokens 7 and 8)")
    assert_equal(trace.allocate_slots("a", 1), [2], f"{trace.what}: the blocks taken (the 9th "
                                                    f"token opens a block)")
    assert_equal(trace.allocate_slots("b", 13), None,
                 f"{trace.what}: the answer (13 tokens need 4 blocks, 3 are free)")
    trace.expect(block_tables={"a": [0, 1, 2]}, num_tokens={"a": 9}, copies=[],
                 ref_counts=[1, 1, 1, 0, 0, 0], free_block_queue=[3, 4, 5])


# ---- fork ----------------------------------------------------------------------------------

def test_fork_shares_every_block_and_takes_none(ex):
    trace = forked(ex)
    trace.expect(block_tables={"a": [0, 1], "b": [0, 1]}, num_tokens={"a": 6, "b": 6},
                 ref_counts=[2, 2] + [0] * 8, free_block_queue=list(range(2, 10)), copies=[])
    trace.manager.block_tables["a"].append(99)
    assert_equal(trace.manager.block_tables["b"], [0, 1],
                 f"{trace.what}, block_tables['a'].append(99): block_tables['b'] (the child's "
                 f"table must be a list of its own, not the parent's)")


def test_a_fork_of_a_fork_counts_every_table(ex):
    trace = forked(ex)  # a, b: [0, 1]; block 1 holds positions 4 and 5
    trace.fork("b", "c")
    assert_equal(trace.manager.ref_counts, [3, 3] + [0] * 8,
                 f"{trace.what}: ref_counts (three tables list blocks 0 and 1; each fork adds "
                 f"one to the count, whatever it was)")
    trace.expect(block_tables={"a": [0, 1], "b": [0, 1], "c": [0, 1]},
                 num_tokens={"a": 6, "b": 6, "c": 6}, free_block_queue=list(range(2, 10)))
    for name, copied in [("c", [2]), ("b", [3]), ("a", [])]:
        assert_equal(trace.allocate_slots(name, 1), copied,
                     f"{trace.what}: the blocks taken (block 1 is copied while another table "
                     f"still lists it; the last of the three writes into it in place)")
    trace.expect(copies=[(1, 2), (1, 3)], block_tables={"a": [0, 1], "b": [0, 3], "c": [0, 2]},
                 ref_counts=[3, 1, 1, 1] + [0] * 6)


def test_a_fork_after_a_copy_on_write_shares_the_copy(ex):
    trace = forked(ex)
    trace.allocate_slots("b", 1)  # b copies block 1 into block 2: a [0, 1], b [0, 2]
    trace.take_copies()
    trace.fork("b", "c")          # c shares b's blocks, the copy included
    trace.expect(block_tables={"a": [0, 1], "b": [0, 2], "c": [0, 2]},
                 num_tokens={"a": 6, "b": 7, "c": 7}, ref_counts=[3, 1, 2] + [0] * 7)
    assert_equal(trace.allocate_slots("c", 1), [3],
                 f"{trace.what}: the blocks taken (c's token 8 lands in block 2, which b also "
                 f"lists: a copy)")
    assert_equal(trace.allocate_slots("a", 1), [],
                 f"{trace.what}: the blocks taken (block 1 is a's alone since b copied)")
    trace.expect(copies=[(2, 3)], block_tables={"a": [0, 1], "b": [0, 2], "c": [0, 3]},
                 ref_counts=[3, 1, 1, 1] + [0] * 6)


def test_a_fork_of_full_blocks_copies_nothing_later(ex):
    trace = forked(ex, prompt=8)
    trace.fork("b", "c")  # three tables over two full blocks
    for name in ("c", "b", "a"):
        trace.allocate_slots(name, 1)
    trace.expect(copies=[], ref_counts=[3, 3, 1, 1, 1] + [0] * 5,
                 block_tables={"a": [0, 1, 4], "b": [0, 1, 3], "c": [0, 1, 2]})


FORK_ERRORS = {
    "fork into a request that has a table": (ValueError, lambda m: m.fork(named("a"), named("a"))),
    "fork an unknown parent": (KeyError, lambda m: m.fork(named("nobody"), named("c"))),
}


@pytest.mark.parametrize("case", list(FORK_ERRORS))
def test_a_bad_fork_raises_and_changes_nothing(ex, case):
    error_type, call = FORK_ERRORS[case]
    trace = Trace(ex, 8, 4)
    trace.allocate_slots("a", 6)
    before = state(trace.manager)
    what = f"{trace.what}, then: {case}"
    expect_raises(error_type, lambda: call(trace.manager), what)
    assert_unchanged(trace.manager, before, what)


# ---- copy-on-write -----------------------------------------------------------------------------

def test_the_first_write_into_a_shared_partly_filled_block_copies_it(ex):
    trace = forked(ex)  # a, b: [0, 1]; block 1 holds positions 4 and 5 in its 4 slots
    assert_equal(trace.allocate_slots("b", 1), [2],
                 f"{trace.what}: the blocks taken (token 7 lands in shared block 1: a fresh "
                 f"block for the copy)")
    trace.expect(block_tables={"a": [0, 1], "b": [0, 2]}, ref_counts=[2, 1, 1] + [0] * 7,
                 num_tokens={"a": 6, "b": 7})
    assert_equal(trace.take_copies(), [(1, 2)], f"{trace.what}: (source, destination) pairs")
    assert_equal(trace.take_copies(), [], f"{trace.what}: the pairs are handed over once")
    assert_equal(trace.allocate_slots("a", 1), [],
                 f"{trace.what}: the blocks taken ('a' now holds block 1 alone: no copy)")
    trace.expect(copies=[], block_tables={"a": [0, 1], "b": [0, 2]},
                 ref_counts=[2, 1, 1] + [0] * 7)


def test_a_full_shared_block_is_never_copied(ex):
    trace = forked(ex, prompt=8)  # a, b: [0, 1], both full
    assert_equal(trace.allocate_slots("b", 1), [2],
                 f"{trace.what}: the blocks taken (token 9 opens a new block; full blocks are "
                 f"never written again, so they stay shared)")
    trace.expect(copies=[], block_tables={"a": [0, 1], "b": [0, 1, 2]},
                 ref_counts=[2, 2, 1] + [0] * 7)


def test_copy_and_new_blocks_in_one_call(ex):
    trace = forked(ex)
    assert_equal(trace.allocate_slots("b", 7), [2, 3, 4],
                 f"{trace.what}: the blocks taken (the copy of shared block 1 first, then 2 "
                 f"blocks past the end for 13 tokens)")
    trace.expect(block_tables={"a": [0, 1], "b": [0, 2, 3, 4]}, copies=[(1, 2)],
                 num_tokens={"a": 6, "b": 13}, ref_counts=[2, 1, 1, 1, 1] + [0] * 5)


def test_no_new_token_copies_nothing(ex):
    trace = forked(ex)
    assert_equal(trace.allocate_slots("b", 0), [],
                 f"{trace.what}: the blocks taken (no token is written)")
    trace.expect(copies=[], block_tables={"a": [0, 1], "b": [0, 1]})


def test_three_siblings_copy_twice(ex):
    trace = forked(ex)
    trace.fork("a", "c")
    for name in ("a", "b", "c"):
        trace.allocate_slots(name, 1)
    trace.expect(copies=[(1, 2), (1, 3)], block_tables={"a": [0, 2], "b": [0, 3], "c": [0, 1]},
                 ref_counts=[3, 1, 1, 1] + [0] * 6)


@pytest.mark.parametrize("num_blocks, num_new_tokens, why", [
    (2, 1, "the copy needs a block and none is free"),
    (3, 3, "exactly 1 block is free, but the copy and one block past the end need 2"),
])
def test_a_refused_copy_changes_nothing(ex, num_blocks, num_new_tokens, why):
    trace = forked(ex, num_blocks=num_blocks)
    before = state(trace.manager)
    got = trace.allocate_slots("b", num_new_tokens)
    what = f"{trace.what} [{why}]"
    assert_equal(got, None, f"{what}: the answer")
    assert_unchanged(trace.manager, before, what)


def test_free_keeps_the_blocks_a_sibling_holds(ex):
    trace = forked(ex)
    trace.allocate_slots("b", 1)  # b: [0, 2], a: [0, 1]
    trace.free("a")
    trace.expect(ref_counts=[1, 0, 1] + [0] * 7, free_block_queue=list(range(3, 10)) + [1],
                 block_tables={"b": [0, 2]})
    trace.free("b")
    trace.expect(ref_counts=[0] * 10, free_block_queue=list(range(3, 10)) + [1, 2, 0],
                 block_tables={}, num_tokens={})


# ---- the same calls on kvlab.paged.KVCacheManager ---------------------------------------------

def replay(ex, num_blocks, block_size, operations):
    """Run `operations` on the learner's manager and on KVCacheManager; compare after each."""
    mine = ex.ForkingKVCacheManager(num_blocks, block_size)
    kvlab = KVCacheManager(num_blocks, block_size)
    done = [f"ForkingKVCacheManager({num_blocks}, block_size={block_size})"]
    for op, *args in operations:
        done.append(f"{op}({', '.join(map(repr, args))})")
        what = ", ".join(done)
        requests = [named(arg) if isinstance(arg, str) else arg for arg in args]
        if op == "allocate_slots":
            try:
                expected = kvlab.allocate_slots(*requests)
            except RequestTooLongError:
                expected = None  # longer than the whole pool: refused too
            before = state(mine)
            assert_equal(mine.allocate_slots(*requests), expected,
                         f"{what}: the blocks taken [as KVCacheManager]")
            if expected is None:
                assert_unchanged(mine, before, what + " (refused)")
        else:
            getattr(kvlab, op)(*requests)
            getattr(mine, op)(*requests)
        assert_equal(mine.take_copies(), kvlab.take_copies(),
                     f"{what}: take_copies() [as KVCacheManager]")
        expected_tables = {rid: kvlab.block_ids(rid) for rid in kvlab.tables}
        assert_equal(mine.block_tables, expected_tables, f"{what}: block_tables [as KVCacheManager]")
        assert_equal(mine.num_tokens, {rid: kvlab.num_tokens(rid) for rid in kvlab.tables},
                     f"{what}: num_tokens [as KVCacheManager]")
        assert_equal(list(mine.ref_counts), [block.ref_count for block in kvlab.pool.blocks],
                     f"{what}: ref_counts [as KVCacheManager]")
        assert_equal(list(mine.free_block_queue),
                     [block.block_id for block in kvlab.pool.free_queue],
                     f"{what}: free_block_queue [as KVCacheManager]")


def test_parallel_sampling_matches_kvlab(ex):
    # One prompt, three samples (n = 3), decoded until the pool runs dry, then one finishes.
    operations = [("allocate_slots", "p", 6), ("fork", "p", "s1"), ("fork", "p", "s2")]
    for _ in range(3):
        operations += [("allocate_slots", name, 1) for name in ("p", "s1", "s2")]
    operations += [("allocate_slots", "p", 1), ("free", "s1"), ("allocate_slots", "p", 1),
                   ("allocate_slots", "s2", 1), ("free", "p"), ("free", "s2")]
    replay(ex, 6, 4, operations)


OPERATION = st.tuples(st.sampled_from(["admit", "allocate_slots", "allocate_slots", "fork",
                                       "free"]),
                      st.integers(0, 99), st.integers(0, 7))


# Quiet, one failure at a time, and no "explain" phase: the failure message itself lists the
# (shrunk) operations.
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          verbosity=Verbosity.quiet, report_multiple_bugs=False,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(steps=st.lists(OPERATION, min_size=1, max_size=25))
def test_random_operations_match_kvlab(ex, steps):
    # Turn the drawn steps into valid operations (on live requests), tracked on a probe manager.
    probe, live, operations = KVCacheManager(6, 3), [], []
    for number, (op, pick, tokens) in enumerate(steps):
        name = f"r{number}"
        if op == "admit" or not live:
            operations.append(("allocate_slots", name, tokens + 1))
            try:
                if probe.allocate_slots(named(name), tokens + 1) is not None:
                    live.append(name)
            except RequestTooLongError:
                pass
        elif op == "fork":
            operations.append(("fork", live[pick % len(live)], name))
            probe.fork(named(live[pick % len(live)]), named(name))
            live.append(name)
        elif op == "free":
            operations.append(("free", live.pop(pick % len(live))))
            probe.free(named(operations[-1][1]))
        else:
            operations.append(("allocate_slots", live[pick % len(live)], tokens % 3))
            try:
                probe.allocate_slots(named(live[pick % len(live)]), tokens % 3)
            except RequestTooLongError:
                pass
        probe.take_copies()
    replay(ex, 6, 3, operations)
